"""Run configuration: frozen dataclasses, loaded from `configs/<name>.toml` plus `--set` overrides.

Each table of a config file belongs to the part of the stack that reads it: `[model]` to the model
family (`model.family`, default llama: spmd.core.family), with its own tables where its config holds
one (`[moe]`: a mixture of experts); `[train]` (the loop: batch, steps, evaluation), `[optimizer]`
(spmd/training/optimizer.py: optimizer, learning-rate schedule, clipping), `[data]`, `[checkpoint]`,
`[pipeline]` (spmd/parallel/pipeline.py), `[sync]` (what crosses between slices:
spmd/parallel/slices.py), `[spikes]` (loss spikes:
spmd/loop/spikes.py), `[lora]` (low-rank adapters on a frozen base: spmd/transforms/lora.py), `[preference]` (DPO, SimPO
and ORPO under `train.objective`: spmd/training/preference.py) and `[cpu]` (CPU tuning: spmd/assembly/policy.py). Keys a file leaves out take the defaults below. `--set
optimizer.learning_rate=1e-3` overrides one key, parsed to the key's type; a key that moved names
its new home.
"""

import dataclasses
import difflib
import pathlib
import types
import typing

from spmd.assembly.policy import CpuConfig
from spmd.core import family as family_lib
from spmd.core import presets as presets_lib
from spmd.core.errors import UserError, closest
from spmd.loop.metrics import MetricsConfig
from spmd.loop.spikes import SpikesConfig
from spmd.parallel.pipeline import PipelineConfig
from spmd.parallel.slices import SyncConfig
from spmd.training.optimizer import OptimizerConfig
from spmd.training.preference import OBJECTIVES, PreferenceConfig

CONFIG_DIR = presets_lib.folder("configs")
MAX_SIZE = 1 << 24  # the largest sequence length or global batch a config may ask for


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 64
    global_batch_size: int = 8  # sequences per optimizer step, over all devices and microbatches
    microbatches: int = 1  # gradient accumulation: the global batch is split into this many
    steps: int = 100
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # 0 disables eval
    eval_batches: int = 4
    # consecutive steps with non-finite loss/gradients (skipped) that stop the run; 0: never
    max_skipped_steps: int = 5
    # what the step minimises: lm (next-token cross-entropy) | dpo | simpo | orpo (preference pairs:
    # spmd.training.preference and the [preference] table; global_batch_size then counts pairs)
    objective: str = "lm"
    # the dtype weight gradients leave their matmuls in, so the dtype they are reduced across devices
    # in: "compute" (model.dtype, as every weight enters the matmuls in it) or "float32" (the
    # projections' and the embedding's gradients accumulated and reduced in fp32 under a 16-bit
    # model.dtype: twice the bytes; models.layers.project)
    grad_reduce_dtype: str = "compute"
    step_timeout: float = 0.0  # hang watchdog (spmd.loop.watchdog): seconds without a finished step or
    # hook before every thread's stack is dumped and the run exits 4; 0: 10x the median step, at
    # least 300; negative: off

    @property
    def sequences(self) -> int:
        """Rows of a global batch: global_batch_size, or two per preference pair."""
        return self.global_batch_size * (1 if self.objective == "lm" else 2)

    def check(self) -> list[str]:
        problems = []
        for key in ("seq_len", "global_batch_size", "microbatches", "steps", "log_every", "eval_batches"):
            if getattr(self, key) < 1:
                problems.append(f"train.{key} must be positive, got {getattr(self, key)}")
        for key in ("seq_len", "global_batch_size"):  # sizes no device holds, refused before any allocation
            if getattr(self, key) > MAX_SIZE:
                problems.append(f"train.{key} must be at most {MAX_SIZE:,}, got {getattr(self, key):,}")
        if self.microbatches >= 1 and self.global_batch_size % self.microbatches:
            problems.append(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"train.microbatches ({self.microbatches})"
            )
        if self.eval_every < 0:
            problems.append(f"train.eval_every must be >= 0, got {self.eval_every}")
        if not 0 <= self.z_loss < float("inf"):
            problems.append(f"train.z_loss must be a finite number >= 0, got {self.z_loss}")
        if self.step_timeout != self.step_timeout or self.step_timeout == float("inf"):
            problems.append(
                f"train.step_timeout must be a number of seconds (0: automatic, < 0: off), got {self.step_timeout}"
            )
        if self.max_skipped_steps < 0:
            problems.append(f"train.max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if self.grad_reduce_dtype not in ("compute", "float32"):
            problems.append(
                f"train.grad_reduce_dtype must be compute or float32, got {self.grad_reduce_dtype!r}"
            )
        if self.objective not in OBJECTIVES:
            problems.append(f"train.objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        return problems


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of a weighted mixture (`[[data.sources]]`): sample i of the run comes from a
    source chosen by a pure function of i (spmd/data/loader.py), so the mixture resumes and reshards."""

    path: str
    weight: float = 1.0
    name: str = ""  # "": the path's last component; names eval_loss/<name>

    @property
    def label(self) -> str:
        return self.name or pathlib.Path(self.path).name or self.path


def parse_sources(value, where: str) -> tuple[Source, ...]:
    """`[[data.sources]]` tables (TOML), a JSON list of them (--set), or Sources already."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(
                f'{where}: data.sources must be a JSON list, e.g. [{{"path": "data/a", "weight": 2}}]'
            ) from None
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{where}: data.sources must be a list of tables with path, weight and name")
    out = []
    for item in value:
        if isinstance(item, Source):
            out.append(item)
            continue
        if not isinstance(item, dict) or "path" not in item or set(item) - {"path", "weight", "name"}:
            raise UserError(
                f"{where}: each data.sources entry takes path (required), weight and name; got {item!r}"
            )
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise UserError(f"{where}: data.sources weight must be a number, got {weight!r}")
        if not isinstance(item["path"], str) or not isinstance(item.get("name", ""), str):
            raise UserError(f"{where}: data.sources path and name must be strings")
        out.append(Source(item["path"], float(weight), item.get("name", "")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str = ""  # "" = the embedded corpus (the Python standard library's source, as bytes)
    format: str = "auto"  # auto | text | npy | bin  (auto: by suffix; a directory is text)
    bin_dtype: str = "uint16"  # token dtype of a raw .bin file: uint16 | uint32
    val_fraction: float = 0.02  # held-out share (by file for the embedded corpus, else the tail)
    mask_token_id: int = -1  # targets equal to this id do not count in the loss; -1: none
    tokenizer: str = ""  # "": the prepared data's own (else bytes) | bytes | a tokenizer.json / .model path
    # concat: windows across documents | segments: documents kept apart (spmd/data/loader.py)
    packing: str = "concat"
    sources: tuple[Source, ...] = ()  # a weighted mixture instead of data.path ([[data.sources]])

    def __post_init__(self):
        object.__setattr__(self, "sources", parse_sources(self.sources, "config"))

    def check(self) -> list[str]:
        problems = []
        if self.sources and self.path:
            problems.append("data.path and data.sources exclude each other: give one data path or a mixture")
        for src in self.sources:
            if not 0 < src.weight < float("inf"):
                problems.append(
                    f"data.sources {src.label!r}: weight must be a positive number, got {src.weight}"
                )
            if not src.path:
                problems.append("data.sources: every source needs a path")
        labels = [src.label for src in self.sources]
        if len(set(labels)) != len(labels):
            problems.append(f"data.sources names must differ (they name eval_loss/<name>), got {labels}")
        if self.packing not in ("concat", "segments"):
            problems.append(f"data.packing must be concat or segments, got {self.packing!r}")
        if self.format not in ("auto", "text", "npy", "bin"):
            problems.append(f"data.format must be auto, text, npy or bin, got {self.format!r}")
        if self.bin_dtype not in ("uint16", "uint32"):
            problems.append(f"data.bin_dtype must be uint16 or uint32, got {self.bin_dtype!r}")
        if not 0 < self.val_fraction < 1:
            problems.append(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        return problems


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end and on preemption)
    keep_last: int = 3  # keep the newest K checkpoints ...
    keep_every: int = 0  # ... plus every step divisible by M (0: none) ...
    keep_best: int = 1  # ... plus the N with the lowest eval loss (0: none) ...
    # ... and always the newest one from before the run's first spike or non-finite step
    async_save: bool = True  # write in the background while training continues
    # storage saves back to back: the next starts at the first step after the previous committed
    continuous: bool = False
    # the local tier (spmd/io/local_tier.py): every local_every steps each process keeps its own
    # shards in local_dir (host memory such as /dev/shm/<name>, or a local disk) ...
    local_every: int = 0
    local_dir: str = ""
    replicas: int = 0  # ... and this many peer processes hold a copy of them

    @property
    def tiered(self) -> bool:
        return self.local_every > 0

    def check(self) -> list[str]:
        problems = []
        if self.every < 0 or self.keep_every < 0 or self.keep_best < 0:
            problems.append("checkpoint.every, checkpoint.keep_every and checkpoint.keep_best must be >= 0")
        if self.keep_last < 1:
            problems.append(f"checkpoint.keep_last must be at least 1, got {self.keep_last}")
        if self.local_every < 0 or self.replicas < 0:
            problems.append("checkpoint.local_every and checkpoint.replicas must be >= 0")
        if self.local_every and not self.local_dir:
            problems.append(
                "checkpoint.local_every needs checkpoint.local_dir: where each host keeps its shards "
                "(host memory such as /dev/shm/<name>, or a local disk)"
            )
        if self.local_dir and not self.local_every:
            problems.append(
                "checkpoint.local_dir is set but checkpoint.local_every is 0: set how often to save there"
            )
        if self.replicas and not self.local_every:
            problems.append(
                "checkpoint.replicas copies the local tier: set checkpoint.local_every and local_dir too"
            )
        return problems


LORA_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The `[lora]` table: low-rank adapters on a frozen base (the transform: spmd/transforms/lora.py)."""

    rank: int = 0  # 0: no adapters, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input, in training
    # the projections adapted; empty: every one the family declares (Llama: q k v o gate up down;
    # GPT-2: q k v o up down)
    targets: tuple[str, ...] = ()
    base_dtype: str = ""  # the frozen weights' dtype: "" keeps model.param_dtype; bfloat16 halves them

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> list[str]:
        problems = []
        if self.rank < 0:
            problems.append(f"lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        if not 0 < self.alpha < float("inf"):
            problems.append(f"lora.alpha must be a positive number, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            problems.append(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.base_dtype not in ("", *LORA_DTYPES):
            problems.append(f"lora.base_dtype must be float32, bfloat16 or float16, got {self.base_dtype!r}")
        return problems


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: object  # the model family's config (spmd.core.family: ModelFamily.config_cls)
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    pipeline: PipelineConfig = PipelineConfig()
    cpu: CpuConfig = CpuConfig()
    metrics: MetricsConfig = MetricsConfig()
    spikes: SpikesConfig = SpikesConfig()
    lora: LoRAConfig = LoRAConfig()
    preference: PreferenceConfig = PreferenceConfig()
    sync: SyncConfig = SyncConfig()

    @property
    def model_family(self) -> family_lib.ModelFamily:
        return family_lib.of(self.model)

    def to_json(self) -> dict:
        return {"name": self.name, **to_tree(self)}


# The tables the engine owns; `[model]` and the tables its config holds belong to the model family.
SECTIONS = {
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "optimizer": OptimizerConfig,
    "pipeline": PipelineConfig,
    "cpu": CpuConfig,
    "metrics": MetricsConfig,
    "spikes": SpikesConfig,
    "lora": LoRAConfig,
    "preference": PreferenceConfig,
    "sync": SyncConfig,
}
# Keys that left the config for the sharding rules (spmd.core.rules): how attention runs when the
# rules shard the sequence belongs to the layout, so it is a key of the rules file.
TO_RULES = {"attention.context_parallel": "context_parallel", "attention.load_balance": "load_balance"}
# Keys that moved to the table that owns them: old key -> its new home. In a config file or --set
# an old key is an error naming the new one; a config saved by an older version (checkpoints,
# config.json) is read with its keys moved.
MOVED = {
    **{
        f"train.{k}": f"optimizer.{k}"
        for k in (
            "learning_rate",
            "warmup_steps",
            "min_lr_ratio",
            "schedule_steps",
            "weight_decay",
            "beta1",
            "beta2",
            "eps",
            "grad_clip",
        )
    },  # fmt: skip
    "train.spike_factor": "spikes.factor",
    "train.spike_window": "spikes.window",
    "train.on_spike": "spikes.action",
    "train.spike_skip_batches": "spikes.skip_batches",
    "train.max_rollbacks": "spikes.max_rollbacks",
    "train.cpu_matmul": "cpu.matmul",
    "train.host_heap": "cpu.host_heap",
    "train.grad_reduce": "cpu.grad_reduce",
    **{
        f"model.{k}": f"moe.{k}"
        for k in (
            "n_experts",
            "top_k",
            "d_ff_expert",
            "n_shared_experts",
            "router_score",
            "capacity_factor",
            "aux_loss_coef",
            "router_z_loss_coef",
        )
    },  # fmt: skip
    "model.moe_every": "moe.every",
    "model.moe_dispatch": "moe.dispatch",
}
FAMILY_KEY = "model.family"
# What users of other stacks type, and the key it is here (for the suggestion in an error).
ALIASES = {
    "lr": "optimizer.learning_rate",
    "wd": "optimizer.weight_decay",
    "warmup": "optimizer.warmup_steps",
    "max_grad_norm": "optimizer.grad_clip",
    "clip": "optimizer.grad_clip",
    "batch_size": "train.global_batch_size",
    "max_steps": "train.steps",
    "seq_length": "train.seq_len",
    "max_seq_len": "train.seq_len",
}


def presets() -> list[str]:
    return presets_lib.names(CONFIG_DIR)


def _type_name(t) -> str:
    if typing.get_origin(t) is tuple:
        return "a list of strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


def _coerce(key: str, value, t, source: str):
    """Check (TOML value) or parse (string from --set) `value` as type `t`."""
    if key == "data.sources":
        return parse_sources(value, source)
    if typing.get_origin(t) is tuple:  # a list of strings: a TOML array, or "a,b" from --set
        if isinstance(value, str) and source == "--set":
            text = value.strip().strip("[]")
            return tuple(part.strip().strip("'\"") for part in text.split(",") if part.strip())
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise UserError(f"{source}: {key} must be {_type_name(t)}, got {value!r}")
    if isinstance(value, str) and source == "--set" and t is not str:
        text = value.strip()
        try:
            if t is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return text.lower() in ("true", "1")
            return t(text)
        except ValueError:
            raise UserError(f"--set {key}={value}: expected {_type_name(t)}") from None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not t:
        raise UserError(f"{source}: {key} must be {_type_name(t)}, got {value!r}")
    return value


def _field_types(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _table_class(t) -> type | None:
    """The dataclass a field of type `t` (a dataclass, or one or None) holds, else None."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        inner = [a for a in typing.get_args(t) if a is not type(None)]
        t = inner[0] if len(inner) == 1 else None
    return t if isinstance(t, type) and dataclasses.is_dataclass(t) else None


def model_tables(family: family_lib.ModelFamily) -> dict[str, type]:
    """The tables a family's config makes: `model` (its scalars) and one per field holding a
    dataclass (e.g. `moe`)."""
    tables = {"model": family.config_cls}
    for name, t in _field_types(family.config_cls).items():
        if _table_class(t) is not None:
            tables[name] = _table_class(t)
    return tables


def _keys(cls, tables) -> dict[str, type]:
    """A table's keys and their types (the fields that are not tables of their own)."""
    return {k: t for k, t in _field_types(cls).items() if k not in tables}


def _family_of(doc: dict, overrides: typing.Sequence[str], source: str) -> family_lib.ModelFamily:
    """The family a config names (`model.family`, a --set of it last), default llama."""
    model = doc.get("model")
    name = model.get("family", family_lib.DEFAULT) if isinstance(model, dict) else family_lib.DEFAULT
    for item in overrides:
        key, eq, value = item.partition("=")
        if eq and key.strip() == FAMILY_KEY:
            name, source = value.strip(), "--set"
    if not isinstance(name, str) or not name:
        raise UserError(f"{source}: {FAMILY_KEY} must be a family name, e.g. llama or gpt2")
    return family_lib.find(name)


def _set(tree: dict, key: str, value, source: str, tables: dict[str, type]) -> None:
    section, _, leaf = key.partition(".")
    if key in MOVED:
        raise UserError(f"config key {key!r} (in {source}) has moved: it is {MOVED[key]!r} now")
    if key in TO_RULES:
        raise UserError(
            f"config key {key!r} (in {source}) is a key of the sharding rules now: write "
            f'{TO_RULES[key]} = {str(value)!r} in a rules file (e.g. one that says extends = "cp_ring") '
            f"and pass it to --rules, or use the preset cp_ring, cp_ulysses or allgather"
        )
    if key == FAMILY_KEY:
        return  # read first, by _family_of
    every = [f"{s}.{k}" for s, c in tables.items() for k in _keys(c, tables)]
    if section not in tables or not leaf or leaf not in _keys(tables[section], tables):
        raise UserError(f"unknown config key {key!r} in {source}{_suggestion(key, every)}")
    types_ = _keys(tables[section], tables)
    tree.setdefault(section, {})[leaf] = _coerce(key, value, types_[leaf], source)


def _suggestion(key: str, every: list[str]) -> str:
    """' (did you mean X?)': a key of the same name in another table, the new home of a key that
    moved, or the closest spelling; '' for none."""
    leaf = key.rpartition(".")[2]
    if leaf in ALIASES:
        return f" (did you mean {ALIASES[leaf]!r}?)"
    same_name = [k for k in every if k.rpartition(".")[2] == leaf]
    if same_name:
        return f" (did you mean {same_name[0]!r}?)"
    match = difflib.get_close_matches(key, every + list(MOVED), n=1, cutoff=0.5)
    if not match:  # by the name alone, in any table
        leaves = {k.rpartition(".")[2]: k for k in every}
        match = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)]
    return f" (did you mean {MOVED.get(match[0], match[0])!r}?)" if match else ""


def to_tree(cfg: Config) -> dict[str, dict]:
    """The config as tables of plain values (what a config file says), `model.family` included."""
    family = cfg.model_family
    tables = {**SECTIONS, **model_tables(family)}
    out = {"model": {"family": family.name}}
    for name, value in ((f.name, getattr(cfg.model, f.name)) for f in dataclasses.fields(cfg.model)):
        if name in tables:
            if value is not None:
                out[name] = dataclasses.asdict(value)
        else:
            out["model"][name] = value
    return {**out, **{s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS}}


def keys_table(cfg: Config) -> str:
    """Every key `--set` takes for this config's model family, with its type and value in `cfg`
    (`spmd-train --list-keys`)."""
    family = cfg.model_family
    tables = {**model_tables(family), **SECTIONS}
    tree = to_tree(cfg)
    rows = [("key", "type", "value")]
    for section, cls in tables.items():
        for key, t in _keys(cls, tables).items():
            value = tree.get(section, {}).get(key, "(table absent)") if section in tree else "(table absent)"
            name = t.__name__ if isinstance(t, type) else str(t)
            rows.append((f"{section}.{key}", name, repr(value) if isinstance(value, str) else str(value)))
    width = [max(len(r[c]) for r in rows) for c in range(2)]
    lines = [f"{a.ljust(width[0])}  {b.ljust(width[1])}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * len(lines[0]))
    head = (
        f"config {cfg.name} (model family {family.name}; model.family picks another): --set section.key=value"
    )
    return head + "\n" + "\n".join(lines)


def _moved(d: dict) -> dict:
    """A saved config's tables with the keys an older version kept elsewhere moved to their
    homes (MOVED); the MoE keys of a dense model (n_experts 0) dropped; the [attention] table
    dropped (its keys now belong to the rules, which the saved run records as they were resolved)."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items() if k != "attention"}
    for old, new in MOVED.items():
        (section, leaf), (home, key) = old.split("."), new.split(".")
        if isinstance(d.get(section), dict) and leaf in d[section]:
            d.setdefault(home, {})[key] = d[section].pop(leaf)
    if isinstance(d.get("moe"), dict) and not d["moe"].get("n_experts", 1):
        del d["moe"]
    return d


def config_from_json(d: dict) -> Config:
    """The inverse of Config.to_json (e.g. the config saved in a checkpoint's metadata)."""
    try:
        d = _moved(d)
        family = family_lib.find(d.get("model", {}).get("family", family_lib.DEFAULT))
        return _construct(d["name"], family, d)
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"saved config is not readable by this version ({e})") from None


def _construct(name: str, family: family_lib.ModelFamily, tree: dict) -> Config:
    tables = model_tables(family)
    model = {k: v for k, v in tree.get("model", {}).items() if k != "family"}
    model.update({t: cls(**tree[t]) for t, cls in tables.items() if t != "model" and t in tree})
    engine = {s: SECTIONS[s](**tree.get(s, {})) for s in SECTIONS}
    return Config(name=name, model=family.config_cls(**model), **engine)


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """A preset name from configs/ or a path to a TOML file, then `key=value` overrides."""
    path = presets_lib.resolve(name_or_path, CONFIG_DIR, "config")
    doc = presets_lib.read(path, "config file")
    family = _family_of(doc, overrides, str(path))
    tables = {**SECTIONS, **model_tables(family)}
    tree: dict[str, dict] = {}
    for section, table in doc.items():
        for leaf in table if isinstance(table, dict) else ():
            if f"{section}.{leaf}" in TO_RULES:  # a table that left the config: the error names its new home
                _set(tree, f"{section}.{leaf}", table[leaf], str(path), tables)
        if section not in tables or not isinstance(table, dict):
            raise UserError(
                f"unknown section {section!r} in config {str(path)!r}{closest(section, tables)}; "
                f"sections are {', '.join(f'[{s}]' for s in tables)} (model family {family.name})"
            )
        for leaf, value in table.items():
            _set(tree, f"{section}.{leaf}", value, str(path), tables)
    return _build(presets_lib.display_name(path, CONFIG_DIR), family, tree, overrides)


def apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """`cfg` with `section.key=value` overrides (as --set gives them), checked like a loaded config."""
    tree = to_tree(cfg)
    family = _family_of(tree, overrides, "the config")
    if family is not cfg.model_family:
        tree = {k: v for k, v in tree.items() if k in SECTIONS}  # another family starts from its defaults
    return _build(cfg.name, family, tree, overrides)


def to_toml(cfg: Config) -> str:
    """A config file that `load_config` reads back as `cfg` (every key written out)."""
    import tomli_w

    return tomli_w.dumps(to_tree(cfg))


def _build(name: str, family, tree: dict[str, dict], overrides: typing.Sequence[str]) -> Config:
    tables = {**SECTIONS, **model_tables(family)}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--set {item!r} must look like section.key=value, e.g. --set train.steps=50")
        _set(tree, key.strip(), value, "--set", tables)
    cfg = _construct(name, family, tree)
    sections = [cfg.model] + [getattr(cfg, s) for s in SECTIONS]
    problems = [p for section in sections for p in section.check()]
    if problems:
        raise UserError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return cfg
