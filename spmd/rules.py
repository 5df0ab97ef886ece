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
import math
import pathlib
import tomllib

from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import UserError, closest
from spmd.mesh import MESH_AXES

PRESET_DIR = pathlib.Path(__file__).resolve().parent.parent / "sharding_rules"

# Every logical axis name the product knows. Models use a subset; a rules file may map names a
# given model does not use (an MoE preset maps `expert`), but never a name outside this list.
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
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


@dataclasses.dataclass(frozen=True)
class Rules:
    name: str
    description: str
    mapping: dict[str, tuple[str, ...]]  # logical name -> mesh axes (empty: replicated)
    replicated_params_ok: bool = False  # e.g. dp: replication is the point, so don't warn
    # How attention sees keys on other devices when `seq` is sharded (spmd/context.py), and the
    # sequence layout that balances causal work. Config [attention] keys override both.
    context_parallel: str = "ring"  # ring | ulysses | allgather
    load_balance: str = "zigzag"  # zigzag | striped | contiguous

    def with_attention(self, attention_cfg) -> "Rules":
        """These rules with the config's [attention] overrides applied."""
        changes = {
            k: getattr(attention_cfg, k)
            for k in ("context_parallel", "load_balance")
            if getattr(attention_cfg, k)
        }
        return dataclasses.replace(self, **changes) if changes else self

    def for_decoding(self) -> "Rules":
        """These rules for KV-cache decoding, which feeds one position per step: nothing to split along
        the sequence. Mesh axes that split only the sequence (context parallelism) split the batch
        instead, so they still do work; axes shared with other names (Megatron SP's `tensor`) keep
        their other jobs."""
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
            "rules": {k: list(v) for k, v in self.mapping.items()},
        }


def load_rules(name_or_path: str) -> Rules:
    """`name_or_path` is a preset name (see `presets()`) or a path to a TOML file."""
    path = pathlib.Path(name_or_path)
    if not (path.suffix == ".toml" or path.exists()):
        path = PRESET_DIR / f"{name_or_path}.toml"
        if not path.exists():
            raise UserError(
                f"unknown rules preset {name_or_path!r}{closest(name_or_path, presets())}; "
                f"presets are {', '.join(presets())}, or pass a path to a .toml file"
            )
    if not path.is_file():
        raise UserError(f"rules file {str(path)!r} not found; pass a preset name or an existing .toml")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"rules file {str(path)!r} is not valid TOML: {e}") from None
    top_keys = ["description", "replicated_params_ok", "context_parallel", "load_balance", "rules"]
    unknown_top = set(doc) - set(top_keys)
    if unknown_top:
        key = sorted(unknown_top)[0]
        raise UserError(f"unknown key {key!r} in rules file {str(path)!r}{closest(key, top_keys)}")
    for key, choices in (("context_parallel", CONTEXT_PARALLEL), ("load_balance", LOAD_BALANCE)):
        if key in doc and doc[key] not in choices:
            raise UserError(
                f"rules file {str(path)!r}: {key} must be one of {', '.join(choices)}, got {doc[key]!r}"
            )
    table = doc.get("rules")
    if not isinstance(table, dict):
        raise UserError(f"rules file {str(path)!r} needs a [rules] table mapping logical axes to mesh axes")
    mapping = {}
    for logical, value in table.items():
        if logical not in LOGICAL_AXES:
            raise UserError(
                f"unknown logical axis {logical!r} in rules file {str(path)!r}"
                f"{closest(logical, LOGICAL_AXES)}; known axes: {', '.join(LOGICAL_AXES)}"
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
        mapping[logical] = axes
    return Rules(
        name=path.stem if path.parent == PRESET_DIR else str(path),
        description=str(doc.get("description", "")),
        mapping=mapping,
        replicated_params_ok=bool(doc.get("replicated_params_ok", False)),
        context_parallel=doc.get("context_parallel", "ring"),
        load_balance=doc.get("load_balance", "zigzag"),
    )


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
        flat = [a for entry in pspec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        dup = {a for a in flat if flat.count(a) > 1}
        if dup:
            raise UserError(
                f"rules {rules.name!r} use mesh axis {sorted(dup)[0]!r} twice for {what} "
                f"(logical axes {logical} -> {pspec}); one mesh axis may shard only one dimension"
            )
        if shapes is None or what not in shapes:
            continue
        for dim, (size, name, entry) in enumerate(zip(shapes[what], logical, pspec)):
            if not entry:
                continue
            axes = (entry,) if isinstance(entry, str) else entry
            n = math.prod(mesh_sizes[a] for a in axes)
            if size % n:
                sizes = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
                raise UserError(
                    f"{what}: dimension {dim} ({name}, size {size}) does not divide by mesh axes "
                    f"{sizes} = {n}; change the mesh, the rules, or the model size"
                )
