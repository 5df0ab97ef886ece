"""Run configuration: frozen dataclasses, loaded from `configs/<name>.toml` plus `--set` overrides.

A config file has up to six tables, `[model]`, `[train]`, `[data]`, `[checkpoint]`,
`[attention]` and `[optimizer]`; keys it leaves out take the defaults below. `--set train.learning_rate=1e-3`
overrides one key, parsed to the key's type.
"""

import dataclasses
import pathlib
import typing

from spmd import presets as presets_lib
from spmd.cpu_matmul import CPU_MATMUL
from spmd.dataparallel import GRAD_REDUCE
from spmd.errors import UserError, closest
from spmd.hostmem import HOST_HEAP
from spmd.models.llama import ModelConfig
from spmd.rules import CONTEXT_PARALLEL, LOAD_BALANCE

CONFIG_DIR = presets_lib.folder("configs")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 64
    global_batch_size: int = 8  # sequences per optimizer step, over all devices and microbatches
    microbatches: int = 1  # gradient accumulation: the global batch is split into this many
    steps: int = 100
    learning_rate: float = 3e-3  # peak, reached after warmup; cosine decay to min_lr_ratio x peak
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    schedule_steps: int = 0  # length of the warmup + cosine schedule; 0: train.steps. Fix it to
    # stop a run early (fewer --steps) or resume with more, without changing the learning rates.
    weight_decay: float = 0.1  # AdamW; not applied to norm scales
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50  # 0 disables eval
    eval_batches: int = 4
    max_skipped_steps: int = (
        5  # consecutive steps with non-finite loss/gradients (skipped) that stop the run; 0: never
    )
    # How a pure data-parallel step sums its gradients: "flat" as one vector per dtype (DDP's
    # buckets; XLA:CPU's gloo pays ~4 ms per all-reduce operand), "xla" as XLA's all-reduce of every
    # array, "auto" flat on CPU across processes (spmd/dataparallel.py)
    grad_reduce: str = "auto"
    # Host memory of XLA:CPU programs (spmd/hostmem.py): "tbbmalloc" relaunches the command under
    # Intel's scalable allocator (the `tbb` wheel; large blocks cached apart from small objects),
    # "retain" keeps glibc's freed heap memory for reuse (each step's temporaries are not faulted in
    # again; the process stays at its peak size), "system" leaves glibc's malloc as it is, "auto"
    # is tbbmalloc where installed (else retain) on a CPU host, system elsewhere
    host_heap: str = "auto"
    # Library for the matmuls of CPU train/eval steps (spmd/cpu_matmul.py): "onednn" (as PyTorch's
    # CPU backend; faster here) or "xla" (XLA:CPU's own choice: YNNPACK, Eigen)
    cpu_matmul: str = "onednn"
    step_timeout: float = 0.0  # hang watchdog (spmd.watchdog): seconds without a finished step or
    # hook before every thread's stack is dumped and the run exits 4; 0: 10x the median step, at
    # least 300; negative: off

    def check(self) -> list[str]:
        problems = []
        for key in ("seq_len", "global_batch_size", "microbatches", "steps", "log_every", "eval_batches"):
            if getattr(self, key) < 1:
                problems.append(f"train.{key} must be positive, got {getattr(self, key)}")
        if self.microbatches >= 1 and self.global_batch_size % self.microbatches:
            problems.append(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"train.microbatches ({self.microbatches})"
            )
        for key in ("warmup_steps", "eval_every", "schedule_steps"):
            if getattr(self, key) < 0:
                problems.append(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 < self.learning_rate < float("inf"):  # also NaN, which can only train to NaN
            problems.append(f"train.learning_rate must be a positive number, got {self.learning_rate}")
        for key in ("weight_decay", "beta1", "beta2", "eps", "grad_clip", "z_loss"):
            if not 0 <= getattr(self, key) < float("inf"):
                problems.append(f"train.{key} must be a finite number >= 0, got {getattr(self, key)}")
        if self.step_timeout != self.step_timeout or self.step_timeout == float("inf"):
            problems.append(
                f"train.step_timeout must be a number of seconds (0: automatic, < 0: off), got {self.step_timeout}"
            )
        if self.grad_reduce not in GRAD_REDUCE:
            problems.append(
                f"train.grad_reduce must be one of {', '.join(GRAD_REDUCE)}, got {self.grad_reduce!r}"
            )
        if self.host_heap not in HOST_HEAP:
            problems.append(f"train.host_heap must be one of {', '.join(HOST_HEAP)}, got {self.host_heap!r}")
        if self.cpu_matmul not in CPU_MATMUL:
            problems.append(
                f"train.cpu_matmul must be one of {', '.join(CPU_MATMUL)}, got {self.cpu_matmul!r}"
            )
        if self.max_skipped_steps < 0:
            problems.append(f"train.max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        return problems


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of a weighted mixture (`[[data.sources]]`): sample i of the run comes from a
    source chosen by a pure function of i (spmd/data.py), so the mixture resumes and reshards."""

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
    # concat: windows across documents | segments: documents kept apart (spmd/data.py)
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


OPTIMIZERS = ("adamw", "adafactor", "lion", "muon", "sgd")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Which optax optimizer (spmd/train.py: make_optimizer). Learning rate, schedule, betas, eps,
    weight decay and clipping stay in [train]."""

    name: str = "adamw"  # adamw | adafactor | lion | muon | sgd
    state_dtype: str = "float32"  # first-moment dtype (adamw, lion, muon, sgd momentum, adafactor momentum)
    momentum: float = 0.9  # sgd's momentum (0: plain sgd)
    # Keep the optimizer state in host memory (memory kind pinned_host) between steps; the step
    # streams it to the device for the update and back. Needs a backend with host memory kinds.
    offload: bool = False

    def check(self) -> list[str]:
        problems = []
        if self.name not in OPTIMIZERS:
            problems.append(f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.state_dtype not in ("float32", "bfloat16"):
            problems.append(f"optimizer.state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
        if not 0 <= self.momentum < 1:
            problems.append(f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        return problems


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end and on preemption)
    keep_last: int = 3  # keep the newest K checkpoints ...
    keep_every: int = 0  # ... plus every step divisible by M (0: none)
    async_save: bool = True  # write in the background while training continues

    def check(self) -> list[str]:
        problems = []
        if self.every < 0 or self.keep_every < 0:
            problems.append("checkpoint.every and checkpoint.keep_every must be >= 0")
        if self.keep_last < 1:
            problems.append(f"checkpoint.keep_last must be at least 1, got {self.keep_last}")
        return problems


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How attention runs when the rules shard the sequence (context parallelism); "" keeps what
    the rules file says (cp_ring: ring + zigzag, cp_ulysses: ulysses, allgather: allgather)."""

    context_parallel: str = ""  # ring | ulysses | allgather
    load_balance: str = ""  # zigzag | striped | contiguous (ring and allgather; Ulysses needs none)

    def check(self) -> list[str]:
        problems = []
        if self.context_parallel not in ("", *CONTEXT_PARALLEL):
            problems.append(
                f"attention.context_parallel must be one of {', '.join(CONTEXT_PARALLEL)}, "
                f"got {self.context_parallel!r}"
            )
        if self.load_balance not in ("", *LOAD_BALANCE):
            problems.append(
                f"attention.load_balance must be one of {', '.join(LOAD_BALANCE)}, got {self.load_balance!r}"
            )
        return problems


PIPELINE_SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over the `stage` mesh axis (spmd/pipeline.py); used when the rules map
    `layers` to `stage` and the mesh has stage > 1."""

    microbatches: int = 0  # pipeline microbatches per (gradient-accumulation) batch; 0: one per stage
    schedule: str = "gpipe"  # gpipe | circular
    repeats: int = 1  # circular: layer groups per stage, visited round-robin (divides the bubble)
    # FSDP inside a stage: gather the stage's weights once per step before the schedule (and
    # reduce their gradients once after it) instead of in every pipeline iteration. Fewer bytes
    # sent; the stage's weights and their gradient sums are held unsharded over fsdp meanwhile.
    gather_once: bool = False

    def check(self) -> list[str]:
        problems = []
        if self.schedule not in PIPELINE_SCHEDULES:
            problems.append(
                f"pipeline.schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {self.schedule!r}"
            )
        if self.microbatches < 0:
            problems.append(f"pipeline.microbatches must be >= 0 (0: one per stage), got {self.microbatches}")
        if self.repeats < 1:
            problems.append(f"pipeline.repeats must be at least 1, got {self.repeats}")
        elif self.repeats > 1 and self.schedule != "circular":
            problems.append(
                f"pipeline.repeats = {self.repeats} needs pipeline.schedule = circular (gpipe holds one "
                f"layer group per stage)"
            )
        return problems


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    attention: AttentionConfig = AttentionConfig()
    pipeline: PipelineConfig = PipelineConfig()

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "optimizer": OptimizerConfig,
    "attention": AttentionConfig,
    "pipeline": PipelineConfig,
}


def presets() -> list[str]:
    return presets_lib.names(CONFIG_DIR)


def _type_name(t) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[t]


def _coerce(key: str, value, t, source: str):
    """Check (TOML value) or parse (string from --set) `value` as type `t`."""
    if key == "data.sources":
        return parse_sources(value, source)
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


def _set(tree: dict, key: str, value, source: str) -> None:
    section, _, leaf = key.partition(".")
    if section not in SECTIONS or not leaf:
        every = [f"{s}.{k}" for s, c in SECTIONS.items() for k in _field_types(c)]
        raise UserError(f"unknown config key {key!r} in {source}{closest(key, every)}")
    types = _field_types(SECTIONS[section])
    if leaf not in types:
        raise UserError(
            f"unknown config key {key!r} in {source}{closest(key, [f'{section}.{k}' for k in types])}"
        )
    tree.setdefault(section, {})[leaf] = _coerce(key, value, types[leaf], source)


def config_from_json(d: dict) -> Config:
    """The inverse of Config.to_json (e.g. the config saved in a checkpoint's metadata)."""
    try:
        return Config(name=d["name"], **{s: SECTIONS[s](**d.get(s, {})) for s in SECTIONS})
    except (KeyError, TypeError) as e:
        raise UserError(f"saved config is not readable by this version ({e})") from None


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """A preset name from configs/ or a path to a TOML file, then `key=value` overrides."""
    path = presets_lib.resolve(name_or_path, CONFIG_DIR, "config")
    doc = presets_lib.read(path, "config file")
    tree: dict[str, dict] = {}
    for section, table in doc.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise UserError(
                f"unknown section {section!r} in config {str(path)!r}{closest(section, SECTIONS)}; "
                f"sections are {', '.join(f'[{s}]' for s in SECTIONS)}"
            )
        for leaf, value in table.items():
            _set(tree, f"{section}.{leaf}", value, str(path))
    return _build(presets_lib.display_name(path, CONFIG_DIR), tree, overrides)


def apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    """`cfg` with `section.key=value` overrides (as --set gives them), checked like a loaded config."""
    return _build(cfg.name, {s: dict(dataclasses.asdict(getattr(cfg, s))) for s in SECTIONS}, overrides)


def to_toml(cfg: Config) -> str:
    """A config file that `load_config` reads back as `cfg` (every key written out)."""
    import tomli_w

    return tomli_w.dumps({s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS})


def _build(name: str, tree: dict[str, dict], overrides: typing.Sequence[str]) -> Config:
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserError(f"--set {item!r} must look like section.key=value, e.g. --set train.steps=50")
        _set(tree, key.strip(), value, "--set")
    cfg = Config(name=name, **{s: SECTIONS[s](**tree.get(s, {})) for s in SECTIONS})
    problems = [p for s in SECTIONS for p in getattr(cfg, s).check()]
    if problems:
        raise UserError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return cfg
