"""The one seam between models and the mesh: logical axis names, activation constraints, and the
parallel implementations a model may call.

Models call `constrain(x, ("batch", "seq", "act_embed"))` and know nothing else about meshes. The
trainer activates a (rules, mesh, ops) triple while it traces the step (`spmd.parallel.sharding.activate`);
outside that, `constrain` is a no-op, so the model runs unchanged on one device, in tests, or under
`jax.eval_shape`.

`ops` is how parallel code that must see the mesh (context-parallel attention, the dropless MoE's
all-to-all) reaches the model without the model importing it: the model asks `provided(name)` for
an implementation only when `is_split(...)` says the active rules need one.

`Lowering` is how the model's platform-dependent pieces lower, decided once for a run's devices
(spmd.assembly.policy) and active while the model traces (`lowered`); models read `lowering()`
and never ask which platform they run on.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Mapping

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.core.mesh import axes_size, spec_axes

# Logical axes of activations that both the model and the parallel implementations name.
Q_AXES = ("batch", "seq", "act_heads", "head_dim")  # queries and attention outputs, BTNH
KV_AXES = ("batch", "seq", "act_kv_heads", "head_dim")  # keys and values, BSKH
TOKEN_AXES = ("batch", "seq")  # token ids, positions, segment ids
# Logical axes that index independent matrices of one parameter (stacked layers, experts), not
# its rows or columns.
MATRIX_BATCH_AXES = ("layers", "expert")


@dataclasses.dataclass(frozen=True)
class Lowering:
    """The platform-dependent forms of the model's computation (module doc)."""

    # attention dots with (B, K) laid end to end as one batch axis: the form XLA:CPU runs fastest;
    # elsewhere B and K stay two batch axes, so that data and tensor splits survive GSPMD
    merge_batch_heads: bool = False
    # softmax attention's backward: "autodiff", or "few_passes" (written for XLA:CPU: as few passes
    # over the scores as the math needs)
    attention_vjp: str = "autodiff"
    interpret: bool = False  # Pallas kernels in interpret mode (the only way they run on CPU)
    # the flash kernel's block sizes (kernels.flash_attention.BlockSizes fields, as (name, value)
    # pairs) measured best on the devices (kernels/tuned.toml); () its defaults
    flash_blocks: tuple = ()
    # the MoE experts' grouped matmuls: "ragged_dot", or "tiles" of one expert's rows (XLA:CPU
    # lowers ragged_dot densely: every row times every expert)
    grouped_matmul: str = "ragged_dot"
    # projections as one 2-D matmul on flattened operands (models.layers.project): XLA:CPU runs the
    # backward of a dot with two contracting axes far slower than the flattened one; elsewhere the
    # dot keeps the weight's own shape, because under FSDP with recomputation the compiler gathers a
    # reshaped weight once per shape (twice the gathers)
    flatten_matmuls: bool = False
    # weight gradients out of the projections' matmuls (and the embedding's scatter-add) in float32,
    # so reduced across devices in it (train.grad_reduce_dtype = "float32"); else in the compute dtype
    float32_weight_grads: bool = False

    @classmethod
    def for_platform(cls, platform: str, flash_blocks: tuple = ()) -> "Lowering":
        cpu = platform == "cpu"
        return cls(
            merge_batch_heads=cpu,
            attention_vjp="few_passes" if cpu else "autodiff",
            interpret=cpu,
            flash_blocks=flash_blocks,
            grouped_matmul="tiles" if cpu else "ragged_dot",
            flatten_matmuls=cpu,
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "flash_blocks": dict(self.flash_blocks)}

    def describe(self) -> str:
        """For the log, e.g. "attention batch x heads merged, softmax backward few_passes, ..."."""
        blocks = ", ".join(f"{k} {v}" for k, v in self.flash_blocks) or "defaults"
        return (
            f"attention batch x heads {'merged' if self.merge_batch_heads else 'apart'}, softmax backward "
            f"{self.attention_vjp}, Pallas {'interpreted' if self.interpret else 'compiled'} (flash blocks "
            f"{blocks}), MoE experts as {self.grouped_matmul}, projections "
            f"{'flattened to 2-D' if self.flatten_matmuls else 'in their own shapes'}"
        )


_LOWERING = contextvars.ContextVar("spmd_lowering", default=None)


@contextlib.contextmanager
def lowered(lowering: Lowering):
    """Context in which a traced model lowers as `lowering` says."""
    token = _LOWERING.set(lowering)
    try:
        yield
    finally:
        _LOWERING.reset(token)


def lowering() -> Lowering:
    """The active Lowering; outside a run (a model traced by hand: tests, notebooks) the one for
    JAX's default devices."""
    current = _LOWERING.get()
    return current if current is not None else Lowering.for_platform(jax.default_backend())


@dataclasses.dataclass(frozen=True)
class Active:
    rules: object  # spmd.core.rules.Rules
    mesh: jax.sharding.Mesh
    ops: Mapping[str, Callable]  # name -> parallel implementation (spmd.parallel.strategy.ops)


_ACTIVE = contextvars.ContextVar("spmd_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(rules, mesh, ops: Mapping[str, Callable] | None = None):
    token = _ACTIVE.set(Active(rules, mesh, dict(ops or {})))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def rules_replaced(rules):
    """The active mesh and parallel ops under other rules (a pipeline's layers: the stage axis is
    the vmapped one, so the batch is split over the other axes)."""
    current = _ACTIVE.get()
    with activation_sharding(rules, current.mesh, current.ops):
        yield


@contextlib.contextmanager
def mesh_replaced(rules, mesh):
    """The active parallel ops under other rules and another mesh (inside a region manual over
    some axes: its abstract mesh, whose manual axes the rules leave out)."""
    current = _ACTIVE.get()
    with activation_sharding(rules, mesh, current.ops):
        yield


def active():
    """The (rules, mesh) pair active while tracing, or None (one device, tests, eval_shape)."""
    current = _ACTIVE.get()
    return None if current is None else (current.rules, current.mesh)


def split_axes(rules, mesh, name: str) -> tuple[str, ...]:
    """The mesh axes, of more than one device, that the logical axis `name` is split over."""
    return tuple(a for a in rules.mapping.get(name, ()) if mesh.shape[a] > 1)


def split_size(rules, mesh, name: str) -> int:
    """How many ways the logical axis `name` is split (1: not split)."""
    return axes_size(mesh.shape, split_axes(rules, mesh, name))


def is_split(name: str) -> bool:
    """Whether the active rules split the logical axis `name` over more than one device."""
    current = _ACTIVE.get()
    return current is not None and bool(split_axes(current.rules, current.mesh, name))


def provided(name: str) -> Callable:
    """The parallel implementation `name` handed in with the active rules."""
    current = _ACTIVE.get()
    if current is None or name not in current.ops:
        raise RuntimeError(
            f"the model needs the parallel implementation {name!r}, which the active sharding does not "
            f"provide; activate rules with spmd.parallel.sharding.activate(rules, mesh)"
        )
    return current.ops[name]


def constrain(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    current = _ACTIVE.get()
    if current is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(current.mesh, current.rules.spec(logical)))


def constrain_whole_over(x: jax.Array, logical: tuple[str | None, ...], over: str) -> jax.Array:
    """constrain(x, logical), except that x's dimensions other than the one named `over` are whole
    over the mesh axes that split the logical axis `over` (e.g. a lookup's ids gathered over the
    devices that share one slice of the table's embed dimension)."""
    current = _ACTIVE.get()
    if current is None:
        return x
    taken = set(current.rules.mapping.get(over, ()))
    spec = []
    for name, entry in zip(logical, current.rules.spec(logical), strict=False):
        kept = spec_axes(entry) if name == over else tuple(a for a in spec_axes(entry) if a not in taken)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return jax.lax.with_sharding_constraint(x, NamedSharding(current.mesh, P(*spec)))


def can_merge(logical: tuple[str, ...]) -> bool:
    """Whether adjacent dimensions with these logical names can be flattened into one without
    moving data: true unless a dimension after the first is split over devices."""
    return not any(is_split(name) for name in logical[1:])


def per_shard(fn, in_logical, out_logical):
    """`fn` applied to each device's shards (shard_map over the active mesh), for ops GSPMD cannot
    partition by itself (Pallas kernels). Identity when no rules are active (one device, tests).

    `in_logical` / `out_logical` give each argument's / the result's logical axes. Axes of size 1
    are left out of the specs; a sharded `seq` axis is refused: per-shard attention would then see
    only part of the sequence (that needs ring or all-to-all attention).
    """
    current = _ACTIVE.get()
    if current is None:
        return fn
    rules, mesh = current.rules, current.mesh

    def spec(logical):
        if "seq" in logical and split_axes(rules, mesh, "seq"):
            raise ValueError(
                f"rules {rules.name!r} shard the sequence, which per-shard attention cannot handle"
            )
        return rules.spec(logical)

    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(spec(names) for names in in_logical),
        out_specs=spec(out_logical),
        check_vma=False,
    )
