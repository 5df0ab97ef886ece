"""Across slices with little traffic (the `[sync]` table): what crosses the slow mesh axes, the
ones the data-center network joins (`--dcn-mesh`, or `sync.axes` for slices simulated in one
process). Traffic inside a slice stays as the rules make it.

Every method needs each slice's own result before anything crosses, so the step runs the slices as
one `vmap` over the slow axes (`spmd_axis_name`, as the pipeline runs its stages): a slice's
gradient (and under DiLoCo its parameters and optimizer state) is one row of an array whose
leading axis is split over the slow axes, and inside a slice the rules are the run's with the slow
axes taken out, so FSDP, tensor, context and expert parallelism run in each slice unchanged. What
crosses is then written out here in the dtype and shape that is sent:

- `compress = bf16`: each slice's gradient in bfloat16, summed across slices in bfloat16 (an
  all-reduce of half the bytes).
- `compress = int8`: each slice's gradient as int8 with float32 scales (absmax, one per row of
  each device's block: a device quantises what it holds), gathered across the slices and summed
  after dequantising. An all-gather sends (n-1)
  bytes per element where a ring all-reduce sends 8(n-1)/n in float32: n/8 of it, a saving below
  8 slices (the usual count: each slice is a pod or a building).
- `compress = powersgd` (rank r): each matrix M of a slice's gradient becomes P = M Q, summed
  across slices, orthonormalised (QR), then Q = M^T P summed; the update is P Q^T. Q is kept
  from step to step (warm start). As PyTorch's PowerSGD hook sees a parameter (its weight stored
  out x in): a projection's rows are its outputs and its columns its inputs, an embedding's rows
  its vocabulary; stacked layers and experts are each their own matrix; one that rank r would
  not halve is summed as it is, and so is every vector; the first `start_step` steps sum
  everything uncompressed.
- Error feedback (`error_feedback`): what a slice's gradient lost to the compression is added to
  its next one (a residual per slice, in the state); under PowerSGD a slice's residual is its input
  less its share (1/n) of the approximated sum, as PyTorch keeps it.
- `method = diloco`: each slice takes H = `inner_steps` steps with its own parameters and
  optimizer state, nothing crossing; then the slices' changes since the last sync (the outer
  gradient, anchor - replica) are averaged across slices (in bf16 or int8 under `compress`) and an
  outer Nesterov SGD step (`outer_lr`, `outer_momentum`) moves the shared parameters, which every
  slice restarts from. The state's `params` are those shared parameters (what evaluation,
  checkpoints and export see); `opt_state` is the slices' inner optimizer states, a row each; the
  `sync` part holds the replicas and the outer momentum.
- `method = streaming_diloco`: the parameters in F = `fragments` fragments (consecutive layers;
  the parameters outside the layer stack go with the first), fragment f synced every H steps at
  its own offset (f + 1) H / F, so each sync sends 1/F of the model and the traffic is spread
  over the H steps. The outer gradient of a fragment is computed from the replicas at the start
  of its step, so its collective depends on nothing the step computes and the scheduler can run it
  under the step's compute; the result is applied at the end of the step, carrying the slice's
  step made meanwhile on top of the new shared parameters (`overlap = true`; false: synced after
  the step, as DiLoCo).

Sync points: outer syncs happen after inner step c (counting from 1) when c % H is the fragment's
offset, and after the run's last step (train.steps), so the final parameters hold every step.

Legend: n slices (the product of the slow axes), F fragments, H inner steps, r rank.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spmd.core.errors import UserError
from spmd.core.logical import MATRIX_BATCH_AXES
from spmd.core.mesh import axes_size, parse_mesh, spec_axes
from spmd.parallel.sharding import path_str
from spmd.parallel.strategy import Attribution, Strategy, rule

SYNC_METHODS = ("allreduce", "diloco", "streaming_diloco")
COMPRESSIONS = ("none", "bf16", "int8", "powersgd")
OUTER_COMPRESSIONS = ("none", "bf16", "int8")  # what DiLoCo's outer gradient may cross as
# PyTorch's min_compression_rate: a matrix is factored only when the factors are under half its size
MIN_COMPRESSION_RATE = 2
INT8_MAX = 127.0


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """The `[sync]` table: how the slices exchange what they learned (module doc)."""

    method: str = "allreduce"  # allreduce | diloco | streaming_diloco
    # The slow mesh axes, comma-separated; "": the axes --dcn-mesh splits. Naming one (e.g. data)
    # simulates slices in one process.
    axes: str = ""
    compress: str = "none"  # none | bf16 | int8 | powersgd (allreduce only)
    rank: int = 1  # powersgd: the rank of the factors
    error_feedback: bool = True  # add what compression lost to the slice's next gradient
    start_step: int = 0  # powersgd: steps summed uncompressed first (PyTorch's start_powerSGD_iter)
    inner_steps: int = 32  # diloco: H, the steps between syncs
    outer_lr: float = 0.7  # diloco: the outer SGD's learning rate (DiLoCo's)
    outer_momentum: float = 0.9  # diloco: its Nesterov momentum (DiLoCo's)
    nesterov: bool = True
    fragments: int = 1  # streaming_diloco: parameter fragments synced in turn
    overlap: bool = True  # streaming_diloco: a fragment's sync runs under the step's compute

    @property
    def active(self) -> bool:
        """Whether anything differs from the all-reduce the partitioner writes."""
        return self.method != "allreduce" or self.compress != "none"

    @property
    def diloco(self) -> bool:
        return self.method in ("diloco", "streaming_diloco")

    def describe(self, named: bool) -> str:
        """One line for the run's log (with the slow axes resolved); `named`: by sync.axes, not by
        --dcn-mesh."""
        across = f"across {self.axes} ({'named by sync.axes' if named else 'the --dcn-mesh axes'})"
        if not self.diloco:
            extra = f", rank {self.rank}" if self.compress == "powersgd" else ""
            feedback = ", error feedback" if self.error_feedback else ""
            return f"gradients {across}: all-reduced as {self.compress}{extra}{feedback}"
        fragments = f" in {self.fragments} fragments" if self.method == "streaming_diloco" else ""
        return (
            f"{self.method} {across}: synced every {self.inner_steps} steps{fragments}, outer SGD lr "
            f"{self.outer_lr} momentum {self.outer_momentum}{' (Nesterov)' if self.nesterov else ''}, "
            f"outer gradient as {'float32' if self.compress == 'none' else self.compress}"
        )

    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.strip() for a in self.axes.split(",") if a.strip())

    def check(self) -> list[str]:
        problems = []
        if self.method not in SYNC_METHODS:
            problems.append(f"sync.method must be one of {', '.join(SYNC_METHODS)}, got {self.method!r}")
        if self.compress not in COMPRESSIONS:
            problems.append(f"sync.compress must be one of {', '.join(COMPRESSIONS)}, got {self.compress!r}")
        elif self.diloco and self.compress not in OUTER_COMPRESSIONS:
            problems.append(
                f"sync.compress = {self.compress} compresses gradients (sync.method = allreduce); "
                f"DiLoCo's outer gradient crosses as {', '.join(OUTER_COMPRESSIONS)}"
            )
        for key in ("rank", "inner_steps", "fragments"):
            if getattr(self, key) < 1:
                problems.append(f"sync.{key} must be at least 1, got {getattr(self, key)}")
        if self.start_step < 0:
            problems.append(f"sync.start_step must be >= 0, got {self.start_step}")
        elif self.start_step and self.compress != "powersgd":
            problems.append(
                f"sync.start_step = {self.start_step} delays PowerSGD only; set sync.compress = powersgd or "
                f"leave sync.start_step at 0"
            )
        if not 0 < self.outer_lr < float("inf"):
            problems.append(f"sync.outer_lr must be a positive number, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            problems.append(f"sync.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.fragments > 1 and self.method != "streaming_diloco":
            problems.append(
                f"sync.fragments = {self.fragments} needs sync.method = streaming_diloco (the others "
                f"sync the whole model at once)"
            )
        if self.fragments > self.inner_steps:
            problems.append(
                f"sync.fragments ({self.fragments}) must be at most sync.inner_steps ({self.inner_steps}): "
                f"each fragment syncs at its own step of the H"
            )
        return problems


def slow_axes(scfg: SyncConfig, mesh_shape, dcn_mesh: str) -> tuple[str, ...]:
    """The mesh axes `scfg` syncs across, in mesh order: sync.axes, else those --dcn-mesh splits;
    () when the sync is the partitioner's plain all-reduce, or there is one slice (nothing
    crosses: the step is one device's). UserError when no axis is named or split."""
    if not scfg.active:
        return ()
    named = scfg.axis_names()
    dcn = {a: n for a, n in parse_mesh(dcn_mesh, "--dcn-mesh").items() if n != 1} if dcn_mesh else {}
    what = (
        f"sync.method = {scfg.method}" if scfg.method != "allreduce" else f"sync.compress = {scfg.compress}"
    )
    if not named and not dcn:
        raise UserError(
            f"{what} needs slow axes to sync across: run across slices with --dcn-mesh data=N, or "
            f"name a mesh axis with sync.axes = data (slices simulated in one process)"
        )
    axes = named or tuple(dcn)
    for a in axes:
        if a not in mesh_shape:
            raise UserError(f"sync.axes names {a!r}, which is not a mesh axis ({', '.join(mesh_shape)})")
    if axes_size(mesh_shape, axes) == 1:  # one slice: nothing crosses, so the step is the plain one
        return ()
    return tuple(a for a in mesh_shape if a in axes)


def check_layout(cfg, plan, axes: tuple[str, ...], update_shardings) -> None:
    """UserError unless every slice holds a whole model and its own rows of the batch: the slow
    axes split the batch (outermost) and no parameter, nor its update."""
    batch_spec = tuple(plan.batch_sharding.spec)
    batch_axes = tuple(a for a in (spec_axes(batch_spec[0]) if batch_spec else ()) if plan.mesh.shape[a] > 1)
    rules = plan.rules.name
    if batch_axes[: len(axes)] != axes:
        raise UserError(
            f"sync across {', '.join(axes)} needs them to split the batch, outermost (data "
            f"parallelism between slices), but rules {rules!r} split it over "
            f"{', '.join(batch_axes) or 'nothing'}; sync across a data-parallel axis (e.g. "
            f"--dcn-mesh data=2 with any rules inside the slices)"
        )
    for name, shardings in (("parameter", plan.param_shardings), ("update", update_shardings)):
        for path, s in jax.tree_util.tree_leaves_with_path(shardings):
            split = {a for e in s.spec for a in spec_axes(e)} & set(axes)
            if split:
                raise UserError(
                    f"sync across {', '.join(sorted(split))}: rules {rules!r} split the {name} "
                    f"{jax.tree_util.keystr(path)} over it, so a slice does not hold a whole model to "
                    f"sync; only a data-parallel axis can be compressed or synced by DiLoCo (map "
                    f"no parameter to it, e.g. --dcn-mesh data=2)"
                )
    if plan.schedule is not None:
        raise UserError(
            f"sync.method = {cfg.sync.method} with a pipeline is not supported: sync across "
            f"slices with sync.method = allreduce and compress = none, or run without stage"
        )
    if cfg.train.objective != "lm":
        raise UserError(
            f"[sync] with train.objective = {cfg.train.objective} is not supported: preference "
            f"tuning syncs with sync.method = allreduce, compress = none"
        )
    if cfg.sync.diloco and cfg.optimizer.offload:
        raise UserError(
            "sync.method = diloco keeps an optimizer state per slice on the device: set "
            "optimizer.offload = false"
        )


@dataclasses.dataclass(frozen=True)
class Slices:
    """The slow axes on a mesh: how a tree gets a leading slice axis split over them."""

    mesh: object
    axes: tuple[str, ...]

    @property
    def n(self) -> int:
        return axes_size(self.mesh.shape, self.axes)

    @property
    def entry(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def stacked(self, sharding: NamedSharding) -> NamedSharding:
        """The sharding of an array with one row per slice of what has `sharding`."""
        return NamedSharding(
            self.mesh, PartitionSpec(self.entry, *sharding.spec), memory_kind=sharding.memory_kind
        )

    def rows(self, batch: dict, batch_sharding: NamedSharding) -> dict:
        """A batch's (B, ...) arrays as (n, B/n, ...): slice i's rows are those it holds."""
        spec = tuple(batch_sharding.spec)
        inner = tuple(a for a in spec_axes(spec[0]) if a not in self.axes)
        rest = PartitionSpec(self.entry, inner[0] if len(inner) == 1 else (inner or None), *spec[1:])

        def one(x):
            x = x.reshape(self.n, x.shape[0] // self.n, *x.shape[1:])
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, rest))

        return jax.tree.map(one, batch)

    def int8_sum(self, m_n, spec: PartitionSpec):
        """(the sum over slices, what this slice sent, dequantised) of the rows `m_n` (float32)
        sent as int8: each device quantises its own block of its slice's row (one scale per row
        of the block's last axis) and gathers the other slices' blocks and scales over the slow
        axes. `spec`: how a row is split inside a slice. Written per device (manual over every
        axis): left to place the blocks, the partitioner gathered the rows whole over the slice
        and converted before sending."""
        row = PartitionSpec(self.entry, *spec)

        # check_vma off: a tiled all_gather's result is the same on every slice, which the
        # varying-axes check does not infer.
        @functools.partial(
            jax.shard_map, mesh=self.mesh, in_specs=row, out_specs=(PartitionSpec(*spec), row), check_vma=False
        )  # fmt: skip
        def summed(m):
            q, scale = _quantize_int8(m)
            q_all = jax.lax.all_gather(q, self.axes, axis=0, tiled=True)
            scale_all = jax.lax.all_gather(scale, self.axes, axis=0, tiled=True)
            return jnp.sum(q_all.astype(jnp.float32) * scale_all, axis=0), q.astype(jnp.float32) * scale

        return summed(m_n)

    def sum(self, x_n, spec: PartitionSpec):
        """The sum of the rows `x_n` as one all-reduce over the slow axes of each device's block,
        in its dtype (what crosses, written out; `spec`: how a row is split inside a slice, () for
        a small array each device holds whole, as PowerSGD's factors: left to the partitioner,
        the TPU compiler failed to fuse their sum with the slicing after it, "AllReduceScatterFusion
        not implemented", or sent the factors' inputs between slices)."""
        row = PartitionSpec(self.entry, *spec)

        @functools.partial(
            jax.shard_map, mesh=self.mesh, in_specs=row, out_specs=PartitionSpec(*spec), check_vma=False
        )
        def summed(x):
            return jax.lax.psum(x[0], self.axes)

        return summed(x_n)

    def broadcast(self, tree, shardings):
        return jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(
                jnp.broadcast_to(x[None], (self.n, *x.shape)), self.stacked(s)
            ),
            tree,
            shardings,
        )


def layer_stacked(plan) -> dict:
    """Per parameter, whether its leading axis is the layer stack."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path_str(path) in plan.layered, plan.abstract_params
    )


def slice_rules(rules, axes: tuple[str, ...]):
    """`rules` as one slice sees them: the slow axes taken out of every name (the vmapped axis is
    the slice)."""
    mapping = {name: tuple(a for a in mapped if a not in axes) for name, mapped in rules.mapping.items()}
    return dataclasses.replace(rules, mapping=mapping)


# --- compression: a tree of per-slice rows (n, ...) to its sum over slices -------------------------


def _quantize_int8(m):
    """(int8 values, float32 scale per row of the last axis): m ~ values * scale."""
    amax = jnp.max(jnp.abs(m), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
    return jnp.clip(jnp.round(m / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def cast_sum(rows_n, residual_n, compress: str, slices: Slices, shardings):
    """(sum over slices in the gradient's dtype, new residual or None) of a tree of per-slice rows
    under bf16 or int8 compression; `residual_n`: error feedback's rows (float32) or None;
    `shardings`: how each row is split inside a slice (the parameter's sharding)."""

    def one(x_n, e_n, s):
        m_n = x_n.astype(jnp.float32) + (0.0 if e_n is None else e_n)
        if compress == "bf16":
            c_n = m_n.astype(jnp.bfloat16)
            sent_n = c_n.astype(jnp.float32)
            total = jnp.sum(c_n, axis=0, dtype=jnp.bfloat16).astype(x_n.dtype)
        else:
            spec = tuple(s.spec) + (None,) * (x_n.ndim - 1 - len(s.spec))
            total, sent_n = slices.int8_sum(m_n, PartitionSpec(*spec))
            total = total.astype(x_n.dtype)
        return total, (None if e_n is None else m_n - sent_n)

    leaves, treedef = jax.tree.flatten(rows_n)
    res = [None] * len(leaves) if residual_n is None else jax.tree.leaves(residual_n)
    out = [one(x, e, s) for x, e, s in zip(leaves, res, jax.tree.leaves(shardings), strict=True)]
    total = jax.tree.unflatten(treedef, [t for t, _ in out])
    return total, None if residual_n is None else jax.tree.unflatten(treedef, [e for _, e in out])


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """How PowerSGD sees one parameter: its axes taken in `order` (the `lead` leading ones index
    separate matrices: stacked layers, experts), then the next `row_axes` axes are the rows and the
    rest the columns; `compressed` when rank r factors are under 1/MIN_COMPRESSION_RATE of it."""

    shape: tuple[int, ...]
    lead: int
    compressed: bool
    order: tuple[int, ...] = ()  # default: as stored
    row_axes: int = 1

    @property
    def ordered(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in (self.order or range(len(self.shape))))

    @property
    def rows(self) -> int:
        return math.prod(self.ordered[self.lead : self.lead + self.row_axes])

    @property
    def cols(self) -> int:
        return math.prod(self.ordered[self.lead + self.row_axes :])

    @property
    def q_shape(self) -> tuple[int, ...]:
        return (*self.shape[: self.lead], self.cols)

    def to_matrices(self, x_n):
        """(n, *shape) -> (n, *lead, rows, cols)."""
        if self.order:
            x_n = jnp.transpose(x_n, (0, *(a + 1 for a in self.order)))
        return x_n.reshape(x_n.shape[0], *self.shape[: self.lead], self.rows, self.cols)

    def from_matrices(self, m):
        """(*lead, rows, cols) -> shape."""
        m = m.reshape(self.ordered)
        return jnp.transpose(m, tuple(np.argsort(self.order))) if self.order else m


def matrix_views(plan, trained_of, rank: int) -> dict:
    """Per trained parameter (a tree like the trained params) its MatrixView (spmd.parallel.slices)
    at `rank`, read from its logical axes as PyTorch stores the weight (out x in): a projection
    from `embed` has the rest as rows, one to `embed` has embed as rows, a vocabulary table its
    vocabulary; UserError when rank r compresses none of them."""
    by_path = {i.path: i for i in plan.params}

    def view(path, x):
        logical = by_path[path_str(path)].logical
        lead = 0
        while lead < len(logical) - 2 and logical[lead] in MATRIX_BATCH_AXES:
            lead += 1
        rest = list(range(lead, len(logical)))
        order, row_axes = (), 1
        if len(rest) >= 2 and logical[lead] == "embed":  # a projection from embed: out = the rest
            order, row_axes = (*range(lead), *rest[1:], lead), len(rest) - 1
        elif len(rest) >= 2 and logical[-1] == "embed" and "vocab" not in logical:  # to embed
            order = (*range(lead), rest[-1], *rest[:-1])
        v = MatrixView(tuple(x.shape), lead, False, order, row_axes)
        ok = len(x.shape) - lead >= 2 and MIN_COMPRESSION_RATE * (v.rows + v.cols) * rank < v.rows * v.cols
        return dataclasses.replace(v, compressed=ok)

    views = trained_of(jax.tree_util.tree_map_with_path(view, plan.abstract_params))
    leaves = jax.tree.leaves(views, is_leaf=lambda v: isinstance(v, MatrixView))
    if not any(v.compressed for v in leaves):
        best = max(
            (v for v in leaves if len(v.shape) - v.lead >= 2), key=lambda v: min(v.rows, v.cols), default=None
        )
        most = (
            0 if best is None else best.rows * best.cols // (MIN_COMPRESSION_RATE * (best.rows + best.cols))
        )
        raise UserError(
            f"sync.rank = {rank} compresses no matrix of this model by half or more (the widest, "
            f"{best.rows}x{best.cols}, needs rank <= {max(most - 1, 0)}); lower sync.rank"
            if best
            else "sync.compress = powersgd: this model trains no matrix to factor; use int8 or bf16"
        )
    return views


def q_init(views, rank: int, seed: int) -> dict:
    """PowerSGD's starting Q per compressed matrix (standard normal; kept between steps)."""
    key = jax.random.key(seed)
    return {
        k: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
        for i, (k, shape) in enumerate(q_shapes(views, rank).items())
    }


def q_shapes(views, rank: int) -> dict:
    leaves = jax.tree.leaves(views, is_leaf=lambda v: isinstance(v, MatrixView))
    return {f"m{i:03d}": (*v.q_shape, rank) for i, v in enumerate(leaves) if v.compressed}


def powersgd_sum(rows_n, residual_n, q, views, slices: Slices, rank: int):
    """(sum over slices, new residual or None, new Q) of per-slice gradient rows by rank-r PowerSGD
    (module doc); uncompressed leaves summed as they are."""
    leaves, treedef = jax.tree.flatten(rows_n)
    vleaves = jax.tree.leaves(views, is_leaf=lambda v: isinstance(v, MatrixView))
    res = [None] * len(leaves) if residual_n is None else jax.tree.leaves(residual_n)
    totals, residuals, new_q = [], [], {}
    n = slices.n
    for i, (x_n, e_n, v) in enumerate(zip(leaves, res, vleaves, strict=True)):
        if not v.compressed:
            totals.append(jnp.sum(x_n, axis=0))
            residuals.append(e_n)
            continue
        m_n = x_n.astype(jnp.float32) + (0.0 if e_n is None else e_n)
        m_nrc = v.to_matrices(m_n)  # (n, ..., rows, cols): ... are the matrices' lead axes
        key = f"m{i:03d}"
        # The factors cross rank-major (r x rows, r x cols): a TPU lays an array's minor dimension out
        # in tiles of 128, so a rank-1 factor sent rows x 1 would travel 128 times its size.
        p = jnp.swapaxes(
            slices.sum(jnp.einsum("n...rc,...ck->n...kr", m_nrc, q[key]), PartitionSpec()), -1, -2
        )
        p_hat = jnp.linalg.qr(p)[0]
        q_sum = jnp.swapaxes(
            slices.sum(jnp.einsum("n...rc,...rk->n...kc", m_nrc, p_hat), PartitionSpec()), -1, -2
        )
        approx = jnp.einsum("...rk,...ck->...rc", p_hat, q_sum)  # the sum of the slices' matrices
        totals.append(v.from_matrices(approx).astype(x_n.dtype))
        residuals.append(None if e_n is None else m_n - v.from_matrices(approx / n)[None])
        new_q[key] = q_sum
    total = jax.tree.unflatten(treedef, totals)
    return total, None if residual_n is None else jax.tree.unflatten(treedef, residuals), new_q


def plain_sum(rows_n):
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), rows_n)


# --- DiLoCo's outer step ----------------------------------------------------------------------


def fragment_bounds(layers: int, fragments: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of the layer stack in each fragment: consecutive, as even as they divide."""
    return [(f * layers // fragments, (f + 1) * layers // fragments) for f in range(fragments)]


def fragment_offsets(inner_steps: int, fragments: int) -> list[int]:
    """c % H at which fragment f syncs after inner step c: (f + 1) H / F (mod H); one fragment: 0."""
    return [((f + 1) * inner_steps // fragments) % inner_steps for f in range(fragments)]


def outer_update(anchor, momentum, delta, scfg: SyncConfig):
    """(anchor, momentum) after one outer SGD step on the outer gradient `delta` (anchor - mean of
    the replicas): momentum m <- mu m + delta, step delta + mu m (Nesterov) or m, as optax.sgd."""
    mu, lr = scfg.outer_momentum, scfg.outer_lr

    def one(a, m, d):
        m = mu * m + d.astype(m.dtype)
        step = d + mu * m if scfg.nesterov else m
        return (a - lr * step).astype(a.dtype), m

    pairs = jax.tree.map(one, anchor, momentum, delta)
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    return (
        jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
        jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
    )


# --- what crosses, analytically -------------------------------------------------------------------


def analytic_sent(cfg, plan, n: int, views=None) -> dict[str, float]:
    """Bytes one device sends to the other slices per step under cfg.sync, and under the plain
    all-reduce it replaces, from the parameters' shards on that device (ring algorithms over n
    slices: an all-reduce sends 2(n-1)/n of its operand, an all-gather (n-1) times its input).
    The plain all-reduce reduces a weight's gradient in the dtype it enters the matmuls in;
    DiLoCo's outer gradient crosses in float32 (bf16 or int8 under compress), amortised over H."""
    scfg = cfg.sync
    ring = 2 * (n - 1) / n
    compute = jnp.dtype(getattr(cfg.model, "dtype", "float32")).itemsize
    plain = sum(
        ring * math.prod(i.local_shape) * (compute if i.compute_cast else i.dtype.itemsize)
        for i in plan.params
    )
    elements = sum(math.prod(i.local_shape) for i in plan.params)
    rows = sum(math.prod(i.local_shape[:-1]) for i in plan.params)  # int8's scales: one per local row
    cast = {"none": ring * 4 * elements, "bf16": ring * 2 * elements, "int8": (n - 1) * (elements + 4 * rows)}
    if scfg.compress == "powersgd" and views is not None:
        local = {i.path: math.prod(i.local_shape) for i in plan.params}
        views = jax.tree_util.tree_leaves_with_path(views, is_leaf=lambda v: isinstance(v, MatrixView))
        # every device of a slice sends the whole factors (they are small); the rest as it is
        factors = sum(
            math.prod(v.shape[: v.lead]) * (v.rows + v.cols) * scfg.rank for _, v in views if v.compressed
        )
        whole = sum(local[path_str(p)] for p, v in views if not v.compressed)
        sent = ring * 4 * (factors + whole)
    elif scfg.diloco:
        sent = cast[scfg.compress] / scfg.inner_steps
    else:
        sent = cast.get(scfg.compress, plain) if scfg.active else plain
    return {"sync": sent, "allreduce": plain}


# --- the strategy: what crosses the slow axes, as spmd-dryrun --explain names it -----------------


def slice_traffic(c, seen):
    """A collective over exactly the [sync] axes, under a sync method or compression."""
    scfg = seen.cfg.sync
    axes = scfg.axis_names() if scfg.active else ()
    if not axes or set(seen.axes) != set(axes):
        return None
    dtype = c.dtypes[0] if getattr(c, "dtypes", ()) else ""
    if all(math.prod(s) <= 1 for s in seen.shapes):
        what = "the slices' loss sums and counts"
    elif scfg.diloco:
        what = {"s8": "the outer gradient as int8 (each device's block)", "f32": "the outer gradient"}.get(
            dtype, f"the outer gradient in {dtype}"
        )
        what += (
            " at a sync" if scfg.compress != "int8" or dtype == "s8" else " (or its int8 scales) at a sync"
        )
    elif scfg.compress == "int8":
        what = "gradients as int8 (each device's block)" if dtype == "s8" else "the int8 gradients' scales"
    elif scfg.compress == "powersgd":
        what = f"PowerSGD's rank-{scfg.rank} factors, and the vectors summed whole"
    else:
        what = f"gradients summed in {dtype or scfg.compress}"
    return rule(["batch"], axes), f"across slices ({scfg.method}): {what}"


STRATEGY = Strategy(name="sync", rank=70, attributions=(Attribution(5, "first", slice_traffic),))
