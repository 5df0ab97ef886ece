"""Declarative sharding rules: TOML files mapping logical axis names to mesh axes.

A rules file looks like

    description = "FSDP (ZeRO-3): ..."
    [rules]
    batch = ["data", "fsdp"]   # a list of mesh axes: the dimension is split over their product
    embed = "fsdp"             # one mesh axis
    vocab = []                 # nothing: replicated

Parameters use the plain names (`embed`, `heads`, ...). Activations that the model constrains use
`act_*` names, so that FSDP can shard a parameter's `embed` dimension without also sharding the
residual stream's (which holds the batch on the same mesh axis).
"""

import dataclasses
import pathlib

from jax.sharding import NamedSharding, PartitionSpec

from spmd.core import presets as presets_lib
from spmd.core.errors import UserError, closest
from spmd.core.mesh import MESH_AXES, axes_size, format_axes, spec_axes

PRESET_DIR = presets_lib.folder("sharding_rules")

# Every logical axis name the engine knows. Models use a subset; a rules file may map names a
# given model does not use (an MoE preset maps `expert`), but never a name outside this list and
# the names model families add (spmd.core.family: ModelFamily.logical_axes).
LOGICAL_AXES = (
    # parameters
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "norm",
    "layers",
    "expert",
    # activations
    "batch",
    "seq",
    "act_seq",
    "act_embed",
    "act_heads",
    "act_kv_heads",
    "act_mlp",
    "act_vocab",
    "act_expert",
    "act_moe_batch",
)

CONTEXT_PARALLEL = ("ring", "ulysses", "allgather")
LOAD_BALANCE = ("zigzag", "striped", "contiguous")


def presets() -> list[str]:
    return presets_lib.names(PRESET_DIR)


@dataclasses.dataclass(frozen=True)
class Rules:
    name: str
    description: str
    mapping: dict[str, tuple[str, ...]]  # logical name -> mesh axes (empty: replicated)
    replicated_params_ok: bool = False  # e.g. dp: replication is the point, so don't warn
    # How attention sees keys on other devices when `seq` is sharded (spmd/parallel/context.py), and the
    # sequence layout that balances causal work: the context-parallel strategy's keys.
    context_parallel: str = "ring"  # ring | ulysses | allgather
    load_balance: str = "zigzag"  # zigzag | striped | contiguous
    # Sharded weight update (ZeRO-1/2, Xu et al. 2020): the optimizer state (and so the update) is
    # further split over these mesh axes, the data axes, while parameters keep their own sharding
    # (spmd/training/trainer.py: update_sharding).
    shard_optimizer_over: tuple[str, ...] = ()
    # Whether spmd-plan proposes this preset (`plan = false`: a root or a baseline). Never
    # inherited: a file that extends one says so itself.
    plan: bool = True
    # Which file set each key (a logical name or a top-level key), through `extends`.
    sources: dict[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def with_defaults(self, names) -> "Rules":
        """These rules with each name of `names` (name -> the name whose mapping it takes, or None
        for replicated) that they do not map given its default: the logical names a model family
        adds."""
        extra = {n: self.mapping.get(d, ()) if d else () for n, d in names.items() if n not in self.mapping}
        if not extra:
            return self
        sources = {
            **self.sources,
            **{n: f"default of {d or 'replicated'}" for n, d in names.items() if n in extra},
        }
        return dataclasses.replace(self, mapping={**self.mapping, **extra}, sources=sources)

    def for_decoding(self) -> "Rules":
        """These rules for KV-cache decoding, which feeds one position per step: nothing to split along
        the sequence. Mesh axes that split only the sequence (context parallelism) split the batch
        instead, so they still do work; axes shared with other names (Megatron SP's `tensor`) keep
        their other jobs. Decoding runs no pipeline: the layer stack is not split, and the axes
        that split it (`stage`) split the batch instead."""
        layer_axes = self.mapping.get("layers", ())
        if layer_axes:
            mapping = dict(self.mapping, layers=())
            for name in ("batch", "act_moe_batch"):
                if name in mapping:
                    mapping[name] = tuple(dict.fromkeys(tuple(layer_axes) + tuple(mapping[name])))
            return dataclasses.replace(self, mapping=mapping).for_decoding()
        seq_axes = tuple(dict.fromkeys(self.mapping.get("seq", ()) + self.mapping.get("act_seq", ())))
        if not seq_axes:
            return self
        used = {a for n, axes in self.mapping.items() if n not in ("seq", "act_seq") for a in axes}
        free = tuple(a for a in seq_axes if a not in used)
        mapping = dict(self.mapping, seq=(), act_seq=())
        for name in ("batch", "act_moe_batch"):
            if name in mapping:
                mapping[name] = mapping[name] + free
        return dataclasses.replace(self, mapping=mapping)

    def spec(self, logical: tuple[str | None, ...]) -> PartitionSpec:
        """PartitionSpec for a tuple of logical names (None: replicated dimension)."""
        out = []
        for name in logical:
            # A tuple of names is a dimension that merges several (e.g. batch and seq flattened
            # into tokens): split over all their mesh axes, major to minor.
            names = () if name is None else (name,) if isinstance(name, str) else name
            axes = tuple(a for n in names for a in self.mapping[n])
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*out)

    def sharding(self, mesh, logical) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical))

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "context_parallel": self.context_parallel,
            "load_balance": self.load_balance,
            **(
                {"shard_optimizer_over": list(self.shard_optimizer_over)} if self.shard_optimizer_over else {}
            ),
            "rules": {k: list(v) for k, v in self.mapping.items()},
        }


TOP_KEYS = (
    "description",
    "plan",
    "extends",
    "replicated_params_ok",
    "context_parallel",
    "load_balance",
    "shard_optimizer_over",
    "rules",
)
DEFAULTS = {
    "description": "",
    "replicated_params_ok": False,
    "context_parallel": "ring",
    "load_balance": "zigzag",
    "shard_optimizer_over": (),
}


def rules_path(name_or_path: str, relative_to: pathlib.Path | None = None) -> pathlib.Path:
    """A preset's file, or a path (relative to `relative_to` when given: an `extends` inside a file)."""
    return presets_lib.resolve(name_or_path, PRESET_DIR, "rules preset", relative_to)


def load_rules(name_or_path: str, names=()) -> Rules:
    """`name_or_path` is a preset name (see `presets()`) or a path to a TOML file. It may map the
    engine's logical names (LOGICAL_AXES), those the built-in model families add, and `names`
    (a family's from elsewhere).

    A file may say `extends = "PRESET"` (or a path to another file, relative to it): it then starts
    from that file's resolved rules and lists only what differs. Every key remembers the file
    that set it (`Rules.sources`, shown by `spmd-train --print-rules`)."""
    known = (*LOGICAL_AXES, *(n for n in family_names() if n not in LOGICAL_AXES))
    known += tuple(n for n in names if n not in known)
    return _load(rules_path(name_or_path), (), known)


def family_names() -> tuple[str, ...]:
    """The logical names the built-in model families add."""
    from spmd.core import family

    return tuple(dict.fromkeys(n for f in family.builtin() for n in family.find(f).logical_axes))


def _display_name(path: pathlib.Path) -> str:
    return presets_lib.display_name(path, PRESET_DIR)


def _read(path: pathlib.Path) -> dict:
    doc = presets_lib.read(path, "rules file", "; pass a preset name or an existing .toml")
    unknown_top = set(doc) - set(TOP_KEYS)
    if unknown_top:
        key = sorted(unknown_top)[0]
        raise UserError(f"unknown key {key!r} in rules file {str(path)!r}{closest(key, TOP_KEYS)}")
    for key, choices in (("context_parallel", CONTEXT_PARALLEL), ("load_balance", LOAD_BALANCE)):
        if key in doc and doc[key] not in choices:
            raise UserError(
                f"rules file {str(path)!r}: {key} must be one of {', '.join(choices)}, got {doc[key]!r}"
            )
    if "extends" in doc and not isinstance(doc["extends"], str):
        raise UserError(
            f"rules file {str(path)!r}: extends must be a preset name or a path, got {doc['extends']!r}"
        )
    table = doc.get("rules", {} if "extends" in doc else None)
    if not isinstance(table, dict):
        raise UserError(f"rules file {str(path)!r} needs a [rules] table mapping logical axes to mesh axes")
    return doc


def _mesh_axes(path: pathlib.Path, logical: str, value, known=LOGICAL_AXES) -> tuple[str, ...]:
    if logical not in known and logical != "shard_optimizer_over":
        raise UserError(
            f"unknown logical axis {logical!r} in rules file {str(path)!r}"
            f"{closest(logical, known)}; known axes: {', '.join(known)}"
        )
    axes = (value,) if isinstance(value, str) else value
    if not isinstance(axes, (list, tuple)) or not all(isinstance(a, str) for a in axes):
        raise UserError(
            f"rules file {str(path)!r}: {logical} must be a mesh axis, a list of mesh axes, "
            f"or [] for replicated; got {value!r}"
        )
    axes = tuple(a for a in axes if a)  # "" also means replicated
    for a in axes:
        if a not in MESH_AXES:
            raise UserError(
                f"rules file {str(path)!r}: {logical} maps to unknown mesh axis {a!r}"
                f"{closest(a, MESH_AXES)}; mesh axes are {', '.join(MESH_AXES)}"
            )
    if len(set(axes)) != len(axes):
        raise UserError(f"rules file {str(path)!r}: {logical} lists a mesh axis twice: {list(axes)}")
    return axes


def _load(path: pathlib.Path, chain: tuple[pathlib.Path, ...], known: tuple[str, ...]) -> Rules:
    if path.resolve() in chain:
        cycle = " -> ".join(_display_name(p) for p in (*chain, path.resolve()))
        raise UserError(
            f"rules files extend each other in a circle: {cycle}; one of them must not say extends"
        )
    doc = _read(path)
    name = _display_name(path)
    parent = None
    if "extends" in doc:
        try:
            parent = _load(rules_path(doc["extends"], path.parent), (*chain, path.resolve()), known)
        except UserError as e:
            raise UserError(f"rules file {str(path)!r} extends {doc['extends']!r}: {e}") from None
    mapping = dict(parent.mapping) if parent else {}
    sources = dict(parent.sources) if parent else {}
    for logical, value in doc.get("rules", {}).items():
        mapping[logical] = _mesh_axes(path, logical, value, known)
        sources[logical] = name
    top = {}
    for key, default in DEFAULTS.items():
        if key in doc:
            top[key], sources[key] = doc[key], name
        else:
            top[key] = getattr(parent, key) if parent else default
    if "shard_optimizer_over" in doc:
        top["shard_optimizer_over"] = _mesh_axes(path, "shard_optimizer_over", doc["shard_optimizer_over"])
    if "plan" in doc and not isinstance(doc["plan"], bool):
        raise UserError(f"rules file {str(path)!r}: plan must be true or false, got {doc['plan']!r}")
    return Rules(
        name=name,
        plan=doc.get("plan", True),
        description=str(top["description"]),
        mapping={n: mapping[n] for n in known if n in mapping},
        replicated_params_ok=bool(top["replicated_params_ok"]),
        context_parallel=top["context_parallel"],
        load_balance=top["load_balance"],
        shard_optimizer_over=tuple(top["shard_optimizer_over"]),
        sources=sources,
    )


def rules_table(rules: Rules) -> str:
    """The resolved rules, one line per key, with the file that set it (`--print-rules`)."""
    rows = [("key", "mesh axes / value", "set by")]
    for key in ("replicated_params_ok", "context_parallel", "load_balance"):
        rows.append((key, str(getattr(rules, key)).lower(), rules.sources.get(key, "default")))
    if rules.shard_optimizer_over:
        rows.append(("shard_optimizer_over", ", ".join(rules.shard_optimizer_over),
                     rules.sources.get("shard_optimizer_over", "default")))  # fmt: skip
    for logical, axes in rules.mapping.items():
        rows.append((logical, ", ".join(axes) or "[] (replicated)", rules.sources.get(logical, "-")))
    width = [max(len(r[c]) for r in rows) for c in range(2)]
    lines = [f"{a.ljust(width[0])}  {b.ljust(width[1])}  {c}" for a, b, c in rows]
    lines.insert(1, "-" * len(lines[0]))
    return f"rules {rules.name}: {rules.description}\n" + "\n".join(lines)


def validate(
    rules: Rules,
    specs: dict[str, tuple[str | None, ...]],
    mesh_sizes: dict[str, int],
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Check a model's logical specs against the rules and the mesh.

    `specs` maps a name (a parameter path, or an activation's name) to its logical axes;
    `shapes` (same keys, optional) gives global shapes to check divisibility.
    """
    used = sorted({n for spec in specs.values() for n in spec if n is not None})
    missing = [n for n in used if n not in rules.mapping]
    if missing:
        raise UserError(
            f"rules {rules.name!r} do not map logical axis {missing[0]!r}, which the model uses"
            f" (unmapped: {', '.join(missing)}); add `{missing[0]} = []` (replicated) or a mesh axis"
        )
    for what, logical in specs.items():
        pspec = rules.spec(logical)
        flat = [a for entry in pspec for a in spec_axes(entry)]
        dup = {a for a in flat if flat.count(a) > 1}
        if dup:
            raise UserError(
                f"rules {rules.name!r} use mesh axis {sorted(dup)[0]!r} twice for {what} "
                f"(logical axes {logical} -> {pspec}); one mesh axis may shard only one dimension"
            )
        if shapes is None or what not in shapes:
            continue
        for dim, (size, name, entry) in enumerate(zip(shapes[what], logical, pspec)):
            n = axes_size(mesh_sizes, spec_axes(entry))
            if size % n:
                raise UserError(
                    f"{what}: dimension {dim} ({name}, size {size}) does not divide by mesh axes "
                    f"{format_axes(mesh_sizes, spec_axes(entry))} = {n}; change the mesh, the rules, or the model size"
                )
