"""From a model's logical axis names and a rules file to concrete shardings, checks and a table.

The model is a family's (spmd.core.family): a Flax NNX module class built as `model_cls(model_cfg,
rngs=...)` whose parameters carry logical axes (`out_sharding` metadata), with the activations it
constrains listed by the family; this module never names a particular model.
"""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd.core import rules as rules_lib
from spmd.core.errors import UserError
from spmd.core.logical import TOKEN_AXES, Lowering, activation_sharding, lowered
from spmd.core.mesh import axes_size, format_mesh, platform_of, spec_axes
from spmd.parallel import pipeline, strategy


@contextlib.contextmanager
def activate(rules, mesh, schedule: pipeline.Schedule | None = None, lowering: Lowering | None = None):
    """Context in which a model traced constrains its activations by `rules` on `mesh`, finds the
    parallel implementations it may need (the pipeline's when there is a `schedule`) and lowers as
    `lowering` says (default: the form for the mesh's platform)."""
    # the parallel implementations the strategies hand models through the seam (logical.provided)
    ops = strategy.ops()
    if schedule is not None:
        ops = {**ops, "pipeline": pipeline.provider(schedule)}
    if schedule is not None and schedule.scheduled:
        ops["pipeline_loss"] = pipeline.loss_provider(schedule)
    with activation_sharding(rules, mesh, ops), lowered(lowering or Lowering.for_platform(platform_of(mesh))):
        yield


# Share of parameter bytes that may stay replicated on a multi-device mesh before we warn.
REPLICATED_WARN_FRACTION = 0.02


def abstract_model(model_cls, model_cfg, seed: int = 0):
    """(graphdef, abstract params State) without allocating anything."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: model_cls(model_cfg, rngs=nnx.Rngs(seed)))
    return nnx.split(model, nnx.Param)


def init_params(model_cls, model_cfg, seed: int):
    """Real parameters as a pure dict; call under jit with out_shardings so each device makes only its shards."""
    with nnx.use_eager_sharding(False):
        model = model_cls(model_cfg, rngs=nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])


def layer_groups(layered: dict) -> int:
    """G, the layer groups the model scans over, from its parameters stacked over layers ({path:
    leading size}): the smallest such stack (an MoE model keeps the dense layers of a group in
    another stack of k * G); 0 without any."""
    return min(layered.values(), default=0)


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    path: str
    logical: tuple[str | None, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: PartitionSpec
    local_shape: tuple[int, ...]
    weight_decay: bool = True  # declared by the model (RMSNorm scales say False)
    # Declared by the model: used cast to the compute dtype (matmul weights), so its gradient
    # arrives, and is reduced, in that dtype; False: used in the parameter dtype (norm scales).
    compute_cast: bool = True

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize

    @property
    def bytes_total(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class ShardingPlan:
    family: object  # the model family (spmd.core.family.ModelFamily) the plan was made for
    model_cfg: object  # its config
    mesh: jax.sharding.Mesh
    rules: rules_lib.Rules
    graphdef: nnx.GraphDef
    abstract_params: dict  # pure dict of ShapeDtypeStruct (with shardings)
    params: list[ParamInfo]
    param_shardings: dict  # pure dict of NamedSharding, same structure as the params
    batch_sharding: NamedSharding  # (batch, seq) token arrays
    replicated: NamedSharding
    schedule: pipeline.Schedule | None = None  # pipeline parallelism over `stage`, if the mesh has it
    # The stacked-layer parameters (path -> leading size) and, where the stored order
    # of their layer groups is not the canonical one (circular pipeline), that order.
    layered: dict = dataclasses.field(default_factory=dict)
    layer_order: np.ndarray | None = None
    # how the model's platform-dependent pieces lower (spmd.assembly.policy decides; spmd.core.logical)
    lowering: Lowering = Lowering()

    @property
    def layer_groups(self) -> int:
        """G, the layer groups the model scans over (`layer_groups`)."""
        return layer_groups(self.layered)

    @property
    def param_bytes_per_device(self) -> int:
        return sum(p.bytes_per_device for p in self.params)

    @property
    def param_bytes_total(self) -> int:
        return sum(p.bytes_total for p in self.params)

    def replicated_fraction(self) -> float:
        """Share of parameter bytes held whole by every device (no mesh axis of size > 1)."""

        def sharded(p):
            return any(self.mesh.shape[a] > 1 for e in p.spec for a in spec_axes(e))

        whole = sum(p.bytes_total for p in self.params if not sharded(p))
        return whole / max(1, self.param_bytes_total)

    def replication_warning(self) -> str | None:
        if self.mesh.size == 1 or self.rules.replicated_params_ok:
            return None
        frac = self.replicated_fraction()
        if frac <= REPLICATED_WARN_FRACTION:
            return None
        return (
            f"warning: {frac:.0%} of parameter bytes stay replicated on every one of the "
            f"{self.mesh.size} devices under rules {self.rules.name!r}; check that the rules map "
            f"the model's large axes (e.g. embed, mlp, vocab) to mesh axes of size > 1"
        )

    def activate(self):
        """Context for tracing the model under this plan's rules, mesh and lowering (see `activate`)."""
        return activate(self.rules, self.mesh, self.schedule, self.lowering)

    def lowered(self):
        """Context for tracing the model per device (inside a shard_map: no activation rules) as
        this plan's lowering says."""
        return lowered(self.lowering)

    def init_params(self, seed: int):
        """Real parameters (pure dict) of this plan's model, in stored layer order; call under jit
        with `param_shardings`."""
        return self.from_canonical(self.canonical_init_params(seed))

    def canonical_init_params(self, seed: int):
        """`init_params` in canonical layer order, as a checkpoint holds them."""
        return init_params(self.family.model_cls, self.model_cfg, seed)

    def from_canonical(self, tree, shardings=None):
        """Parameters (or a state holding them) in canonical layer order -> as this plan stores
        them (the circular pipeline's order); identity for any other plan. Traceable; given
        `shardings` (the tree's), concrete arrays are permuted by a jitted program onto them."""
        return self._reorder(tree, self.layer_order, shardings)

    def to_canonical(self, tree, shardings=None):
        """The inverse of `from_canonical`: the order checkpoints hold."""
        order = None if self.layer_order is None else np.argsort(self.layer_order)
        return self._reorder(tree, order, shardings)

    def _reorder(self, tree, order, shardings):
        if order is None:
            return tree
        # Each leaf stacked like a layer parameter (the parameter, its optimizer moments) permuted.
        rows = jax.tree_util.tree_map_with_path(
            lambda path, _: self.layered.get(path_str(path), 0), self.abstract_params
        )

        def permute(t):
            return like_params(
                t,
                rows,
                lambda leaf, n: (
                    pipeline.permute_leading(leaf, order) if n and leaf.shape[:1] == (n,) else leaf
                ),
                None,
            )

        return permute(tree) if shardings is None else jax.jit(permute, out_shardings=shardings)(tree)


def _local_shape(shape, spec, sizes) -> tuple[int, ...]:
    out = []
    for i, size in enumerate(shape):
        out.append(size // axes_size(sizes, spec_axes(spec[i] if i < len(spec) else None)))
    return tuple(out)


def plan(
    family,
    model_cfg,
    mesh,
    rules: rules_lib.Rules,
    global_batch_size: int,
    seq_len: int,
    microbatches: int = 1,
    pipeline_cfg=None,
    lowering: Lowering | None = None,
    objective: str = "lm",
) -> ShardingPlan:
    """Validate the rules against the model (of `family`, spmd.core.family) and mesh, and resolve every
    sharding. `pipeline_cfg` (spmd.parallel.pipeline.PipelineConfig) is the schedule when the rules split
    `layers` over `stage`; `objective` (train.objective) has a say in how GPipe's backward runs.
    `rules` may leave out the logical names the family adds (they take their default mapping)."""
    rules = rules.with_defaults(family.logical_axes)
    graphdef, abstract = abstract_model(family.model_cls, model_cfg)
    sizes = mesh.shape
    flat = [(path_str(path), var) for path, var in nnx.to_flat_state(abstract)]
    specs = {p: tuple(v.get_metadata().get("out_sharding") or (None,) * len(v.shape)) for p, v in flat}
    shapes = {p: tuple(v.shape) for p, v in flat}
    micro = global_batch_size // microbatches
    activations = family.activations(model_cfg, micro, seq_len)
    act_specs = {"batch tokens": TOKEN_AXES, **{k: axes for k, (axes, _) in activations.items()}}
    act_shapes = {"batch tokens": (micro, seq_len), **{k: s for k, (_, s) in activations.items() if s}}
    figures = family.figures(model_cfg, seq_len)
    problems = strategy.problems(rules, mesh, figures, seq_len)  # each strategy's checks
    if problems:
        raise UserError(problems[0])
    layered = {p: shapes[p][0] for p in specs if specs[p] and specs[p][0] == "layers"}
    groups = layer_groups(layered)
    schedule = pipeline.schedule_for(pipeline_cfg, mesh, rules, groups, micro, figures.n_layers, objective)
    rules_lib.validate(rules, {**specs, **act_specs}, sizes, {**shapes, **act_shapes})
    # The KV cache exists only when decoding, which runs under the decoding rules (no pipeline).
    rules_lib.validate(rules.for_decoding(), family.cache_axes(model_cfg, False), sizes)

    infos = []
    for p, v in flat:
        spec = rules.spec(specs[p])
        infos.append(
            ParamInfo(
                p,
                specs[p],
                shapes[p],
                np.dtype(v.dtype),
                spec,
                _local_shape(shapes[p], spec, sizes),
                weight_decay=bool(v.get_metadata().get("weight_decay", True)),
                compute_cast=bool(v.get_metadata().get("compute_cast", True)),
            )
        )
    by_path = {i.path: i for i in infos}

    def sharding_for(path, _):
        return NamedSharding(mesh, by_path[path_str(path)].spec)

    pure = nnx.to_pure_dict(abstract)
    param_shardings = jax.tree_util.tree_map_with_path(sharding_for, pure)
    abstract_params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(path, x)), pure
    )
    return ShardingPlan(
        family=family,
        model_cfg=model_cfg,
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        abstract_params=abstract_params,
        params=infos,
        param_shardings=param_shardings,
        batch_sharding=rules.sharding(mesh, TOKEN_AXES),
        replicated=NamedSharding(mesh, PartitionSpec()),
        schedule=schedule,
        layered=layered,
        layer_order=pipeline.layer_order(groups, schedule),
        lowering=lowering or Lowering.for_platform(platform_of(mesh)),  # (a plan made by hand)
    )


def update_sharding(rules, mesh, sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """Where an optimizer-state array of a parameter sharded as `sharding` lives: the parameter's
    sharding, further split over the rules' `shard_optimizer_over` axes (the sharded weight update,
    ZeRO-1/2) on the first dimension they divide. Axes of size 1, axes the parameter already uses,
    and arrays no dimension of which divides stay as the parameter is."""
    sizes = dict(mesh.shape)
    used = {a for entry in sharding.spec for a in spec_axes(entry)}
    extra = tuple(a for a in rules.shard_optimizer_over if sizes.get(a, 1) > 1 and a not in used)
    if not extra or not shape:
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for dim, size in enumerate(shape):
        axes = spec_axes(spec[dim])
        if size % (axes_size(sizes, axes) * axes_size(sizes, extra)) == 0:
            merged = axes + extra
            spec[dim] = merged[0] if len(merged) == 1 else merged
            return NamedSharding(mesh, PartitionSpec(*spec))
    return sharding


def like_params(state, params, f, default):
    """Map each leaf of `state` (an optimizer state) to f(leaf, its parameter), or to `default`
    where no parameter matches (None: the leaf itself). A leaf's parameter is the one whose path (dict keys) ends the
    leaf's path: optax states hold trees shaped like the parameters under wrappers (chain, masks,
    partitions such as Muon's), possibly with some parameters left out, which
    `optax.tree_map_params` cannot map."""
    by_path = {tuple(k.key for k in path): p for path, p in jax.tree_util.tree_flatten_with_path(params)[0]}
    longest = max(map(len, by_path), default=0)

    def one(path, leaf):
        keys = []
        for k in reversed(path):  # the trailing run of dict keys
            if not isinstance(k, jax.tree_util.DictKey):
                break
            keys.insert(0, k.key)
        for n in range(min(len(keys), longest), 0, -1):
            p = by_path.get(tuple(keys[-n:]))
            if p is not None:
                return f(leaf, p)
        return leaf if default is None else default

    return jax.tree_util.tree_map_with_path(one, state)


def tree_bytes_per_device(abstract_tree) -> int:
    """Bytes each device holds of a tree of ShapeDtypeStructs with shardings (the most loaded device)."""
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_spec(spec: PartitionSpec) -> str:
    parts = []
    for e in spec:
        parts.append("-" if not e else e if isinstance(e, str) else "(" + ",".join(e) + ")")
    return "P(" + ", ".join(parts) + ")"


def sharding_table(p: ShardingPlan, opt_state_abstract=None) -> str:
    """Every parameter's logical axes, PartitionSpec, global and per-device shape and bytes; totals."""
    rows = [("parameter", "logical axes", "spec", "global shape", "per-device shape", "bytes/device")]
    for i in p.params:
        rows.append(
            (
                i.path,
                "(" + ", ".join(n or "-" for n in i.logical) + ")",
                format_spec(i.spec),
                "x".join(map(str, i.shape)),
                "x".join(map(str, i.local_shape)),
                fmt_bytes(i.bytes_per_device),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if c < 5 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(f"mesh: {format_mesh(p.mesh.shape)} ({p.mesh.size} devices); rules: {p.rules.name}")
    lines.append(
        f"parameters: {sum(math.prod(i.shape) for i in p.params):,} ({fmt_bytes(p.param_bytes_total)} in all)"
    )
    lines.append(
        f"per device: params {fmt_bytes(p.param_bytes_per_device)}"
        + (
            f", optimizer state {fmt_bytes(tree_bytes_per_device(opt_state_abstract))}"
            f", total {fmt_bytes(p.param_bytes_per_device + tree_bytes_per_device(opt_state_abstract))}"
            if opt_state_abstract is not None
            else ""
        )
    )
    lines.append(f"replicated share of parameter bytes: {p.replicated_fraction():.1%}")
    warning = p.replication_warning()
    if warning:
        lines.append(warning)
    return "\n".join(lines)
