"""The pipeline's scheduled backward: 1F1B, interleaved 1F1B and ZB-H1 as one program over `stage`.

GPipe and circular (spmd/parallel/pipeline.py) get their backward from autodiff of the forward
loop, so the backward starts after the last microbatch's forward and each stage keeps what its
remat policy saves for every microbatch. Here the loss is part of the schedule: the output head
and the loss run on each microbatch as it leaves the last stage, and each stage runs the forwards
and backwards of the microbatches in front of it tick by tick (a per-stage `jax.vjp`, its residuals
kept in a ring of slots until that microbatch's backward comes round). A stage then holds at most
2 R S - 1 microbatches' residuals (chunk-sized when R > 1; S under 1F1B) whatever M is; residuals computed from
the weights alone are recomputed in the backward instead (`weight_only`). Stage 0 embeds each
microbatch as it enters and adds its embedding's gradient as its backward leaves, so nothing the
size of the whole batch is held either.

Lockstep: every stage runs the same pass in the same tick (one `vmap` over the stage axis, as
pipeline.py explains), so a tick costs one forward and one backward of a chunk whichever stages
have work. Microbatches go through in groups of S; within a group microbatch j = m mod S of group
g = m div S visits chunk r of stage s (the canonical virtual stage v = r S + s)

    forward  at tick  g S R + r S + j + s
    backward at tick  g S R + (2R - 2 - r) S + j + 2S - 2 - s

so a microbatch leaving stage S-1 reaches stage 0 (its next chunk) in the next tick, its gradient
leaving stage 0 reaches stage S-1 in the next, and no stage has two forwards or two backwards in a
tick. (With R = 1 this would be a lockstep 1F1B: forward of m at tick m + s, its backward at tick
m + 2S - 2 - s; 1F1B diverges instead, below.) Ticks: R M + R S + S - 2, in three phases: warm-up (R S
- 1 ticks, forwards only), steady (R (M - S) + S ticks, forward, loss and backward), cool-down (R S
- 1 ticks, backwards only). Each stage does R M forwards and R M backwards of a chunk in R M + S - 1
ticks of each pass: the bubble is (S - 1) / (R M + S - 1), GPipe's and circular's.

Interleaved zero-bubble (`Ticks.split`) cuts each backward in two (split_backward.py): B, the
input's gradient, at the tick above, and W, the weights' gradient, of a microbatch's chunk on
every stage at the tick stage 0 runs that chunk's B: the R M weight passes run in ticks where every
stage has one, so a step is (R M + S - 1) (F + B) / R + M W, not (R M + S - 1) (F + B + W) / R. What
W reads from B (per layer, each weight matmul's operands: the cotangent at its output and, under
remat, its recomputed input) waits in a ring of S slots (stage s's W runs s ticks after its B; the
slot is the microbatch's place j in its group); the forward residuals W also reads stay in
theirs, which 2 R S - 1 slots cover (W runs at most 2 R S - 2 ticks after the forward).

1F1B and ZB-H1 (`Ticks.diverge`, R = 1) are not lockstep: their stages run different passes in the
same tick and nothing in the ticks they idle (`_diverged`, in a `shard_map` manual over the stage
axes, the passes above traced once on one stage), from diverging.py's tables.

The whole schedule is one `jax.custom_vjp` whose forward computes the loss and every gradient (the
layers', the head's, and the stage-0 input's, which autodiff carries back into the embedding); its
backward scales them by the loss's cotangent. The loss it returns is the sum of the tail's per
microbatch losses plus `aux_loss` of the layers' statistics; `aux_loss` must be linear in them (the
trainer's weighted auxiliary losses are), so its gradient is a constant fed to every backward.

Legend: S stages, R chunks (repeats) per stage, M microbatches, K residual slots, b rows per
microbatch, T sequence, D embed.
"""

import contextlib
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jax_core
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from spmd.core.logical import mesh_replaced, rules_replaced
from spmd.parallel import diverging, split_backward

# The named scopes of the activations' and the gradients' moves between stages.
FORWARD_SCOPE, BACKWARD_SCOPE = "pipeline_forward", "pipeline_backward"
# The named scope of the deferred weight-gradient passes (zero-bubble).
WEIGHT_SCOPE = "pipeline_weight"
# The named scope of the head and loss on the microbatch leaving the last stage, run conditionally
# when R > 1 (its share of the ticks is `Ticks.branch_shares`).
TAIL_SCOPE = "pipeline_tail"
# Stages that diverge (1F1B, ZB-H1): the named scope of each branch a tick's switch may have (the
# last is the idle one, with nothing in it), prefixed by PASS_SCOPE; a schedule's switch has those
# its table uses (`Ticks.branch_names`).
PASS_SCOPE = "pipeline_pass_"
BRANCHES = ("forward_first", "forward", "forward_last", "input_grad_first", "input_grad", "weight",
            "backward_first", "backward", "idle")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Ticks:
    """The tick plan of a scheduled pipeline: S stages, M microbatches, R chunks per stage."""

    stages: int
    microbatches: int
    repeats: int = 1
    # Zero-bubble (ZB-H1 with R = 1, interleaved with R > 1): each backward split into the input's
    # gradient (B, at the backward's tick) and the weights' (W, deferred on every stage to the tick
    # stage 0 runs B of the same microbatch chunk).
    split: bool = False
    # Stages that diverge (1F1B, ZB-H1: R = 1): each tick each stage runs the one pass its row of
    # diverging.table names, in a conditional (`_diverged`).
    diverge: bool = False

    @property
    def total(self) -> int:
        S, M, R = self.stages, self.microbatches, self.repeats
        if self.diverge:
            return self.table.ticks
        return R * M + R * S + S - 2

    @property
    def table(self) -> "diverging.Table":
        return diverging.table(self.stages, self.microbatches, self.split)

    def _branch_table(self) -> np.ndarray:
        """(S, T): the index in BRANCHES of the branch stage s runs at tick t (diverge)."""
        tab, S = self.table, self.stages
        by_kind = {diverging.FORWARD: "forward", diverging.INPUT_GRAD: "input_grad",
                   diverging.WEIGHT_GRAD: "weight", diverging.BACKWARD: "backward",
                   diverging.IDLE: "idle"}  # fmt: skip
        out = np.zeros(tab.kind.shape, np.int32)
        for s in range(S):
            for t, kind in enumerate(tab.kind[s]):
                name = by_kind[int(kind)]
                if name in ("forward", "input_grad", "backward") and s == 0:
                    name += "_first"
                elif name == "forward" and s == S - 1:
                    name += "_last"
                out[s, t] = BRANCHES.index(name)
        return out

    def branch_names(self) -> tuple[str, ...]:
        """The branches of the tick's switch (diverge): those of BRANCHES the table uses, in its
        order (idle last)."""
        used = set(self._branch_table().ravel().tolist())
        return tuple(name for i, name in enumerate(BRANCHES) if i in used)

    def branches(self) -> np.ndarray:
        """(S, T): the index in `branch_names` of the branch stage s runs at tick t (diverge)."""
        names = self.branch_names()
        index = np.asarray([names.index(n) if n in names else -1 for n in BRANCHES], np.int32)
        return index[self._branch_table()]

    @property
    def warmup(self) -> int:
        """Ticks before the first backward (forwards only)."""
        return self.repeats * self.stages - 1

    @property
    def steady_end(self) -> int:
        """The first tick with no forward."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def slots(self) -> int:
        """Residual slots per stage: the most microbatch chunks one stage holds between their
        forward and their backward (2 R S - 1 for stage 0's first chunk), or all R M if fewer."""
        S, M, R = self.stages, self.microbatches, self.repeats
        if self.diverge:
            return self.table.residual_slots
        return min(2 * R * S - 1, R * M)

    @property
    def weight_start(self) -> int:
        """The first tick with a deferred weight-gradient pass (split only): stage 0's first
        backward."""
        return (self.repeats + 1) * self.stages - 2

    def phases(self) -> list[tuple[int, int, bool, bool, bool]]:
        """(first tick, end, forward, backward, weight) of each run of ticks that do the same
        passes; `weight`: a deferred weight-gradient pass (split), else it is part of backward."""
        W, E, T = self.warmup, self.steady_end, self.total
        if not self.split:
            return [(0, W, True, False, False), (W, E, True, True, False), (E, T, False, True, False)]
        V = self.weight_start
        return [(0, W, True, False, False), (W, V, True, True, False), (V, E, True, True, True),
                (E, T, False, True, True)]  # fmt: skip

    @property
    def branch_shares(self) -> dict[str, float]:
        """{named scope: share of the ticks of its pass that run it} for each conditional of the
        schedule whose work a count of the compiled step must weigh (`hlo.matmul_flops`): with
        R > 1 the tail runs on M of the steady ticks (R M + S - 1 - (R S - 1) of them), where a
        microbatch leaves its last chunk. Stage 0's embedding gradient is conditional too, with no
        matmul."""
        if self.diverge:
            # Every device runs the tick's conditional T times; a branch's share is its runs over
            # all stages' ticks (the count is then the mean over stages).
            branches, names = self.branches(), self.branch_names()
            counts = np.bincount(branches.ravel(), minlength=len(names)) / branches.size
            return {
                PASS_SCOPE + name: float(c) for name, c in zip(names, counts, strict=True) if name != "idle"
            }
        if self.repeats == 1:
            return {}
        return {TAIL_SCOPE: self.microbatches / (self.steady_end - self.warmup)}

    def weight(self, t):
        """(valid, microbatch, chunk, forward index) of every stage's deferred weight-gradient pass
        at tick t: the chunk stage 0, the last to run its backward, runs B of in that tick
        (microbatch m's at tick m + 2S - 2 with R = 1)."""
        return self.backward(t, 0)

    def _split(self, k):
        S, R = self.stages, self.repeats
        g, within = k // (S * R), k % (S * R)
        return g * S + within % S, within // S  # microbatch, chunk

    def forward(self, t, s):
        """(valid, microbatch, chunk, index) of stage s's forward at tick t; `index` counts the
        stage's forwards (its residual slot is index mod K)."""
        k = t - s
        m, r = self._split(k)
        return (k >= 0) & (k < self.repeats * self.microbatches), m, r, k

    def backward(self, t, s):
        """(valid, microbatch, chunk, forward index) of stage s's backward at tick t."""
        S, R = self.stages, self.repeats
        u = t - (2 * S - 2 - s) - (R - 1) * S  # g S R + (R - 1 - r) S + j
        g, within = u // (S * R), u % (S * R)
        m, r = g * S + within % S, R - 1 - within // S
        k = g * S * R + r * S + within % S  # the index of the forward it undoes
        return (u >= 0) & (u < R * self.microbatches), m, r, k


def weight_only(stage_fwd, x, w_c, side_b):
    """(a function computing, from the weights and side inputs, the residual leaves of `stage_fwd`
    that do not depend on the microbatch's activations, and for each leaf whether it does), by
    JAX's partial evaluation with the activations unknown."""
    closed = jax.make_jaxpr(lambda x, w_c, side_b: stage_fwd(x, w_c, side_b)[2])(x, w_c, side_b)
    n_known = len(jax.tree.leaves((w_c, side_b)))
    known, _, depends, _ = pe.partial_eval_jaxpr_nounits(
        closed, [True] + [False] * n_known, instantiate=False
    )
    n_out = depends.count(False)
    known, _ = pe.dce_jaxpr(known.replace(outvars=known.outvars[:n_out]), [True] * n_out, instantiate=True)
    return jax_core.jaxpr_as_fun(known), depends


def _where(mask_S, new, old):
    return jnp.where(mask_S.reshape(-1, *[1] * (new.ndim - 1)), new, old)


def loss(layers_fn, embed, inputs, w, side, *, head, tail, rows, ticks: Ticks, tail_rules, **kw):
    """(loss, tail sums, combined stats) of the schedule, differentiable (module doc) in `w` and
    the parameters `embed` and `head` close over.

    `embed(inputs_rows) -> x_bTD`: the stack's input for some rows, run by stage 0 on each
    microbatch as it enters (`inputs`: per-row, leading axis B);
    `layers_fn(x_bTD, w_chunk, side_rows) -> (x, stats or None)`: one chunk of a stage; `w`: leaves
    (S, R, Gps, ...); `side`: per-row layer inputs (leading B); `head(x_bTD) -> logits`;
    `tail(logits, rows) -> (loss, sums)` with `rows` per-row (leading B); `aux_loss(stats) -> loss`,
    linear, of `combine_stats(canonical(stats sums), M)`. The sums and statistics are metrics: no
    gradient flows back from them."""
    M = ticks.microbatches
    inputs_b = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // M, *a.shape[1:]), a.dtype), inputs)
    # Under ZB-H1 with stages that diverge the embedding and head run inside a region manual over
    # the stage axes: traced for its mesh and rules. The embedding's table is looked up whole there
    # (gathered for each lookup, as FSDP gathers a layer's weights): XLA's partitioner aborts on a
    # lookup in a table split over the automatic axes inside a region manual over others (a check
    # on its device groups), whether its rows or its columns are split.
    if ticks.diverge:
        region = _region_rules(kw["inner"], kw["axes"])
        table_whole = dataclasses.replace(region, mapping={**region.mapping, "vocab": (), "embed": ()})
        embedding_tracing = _region_tracing(table_whole, kw["axes"], kw["mesh"])
        head_tracing = _region_tracing(region, kw["axes"], kw["mesh"])
    else:
        embedding_tracing, head_tracing = rules_replaced(tail_rules), rules_replaced(tail_rules)
    with embedding_tracing:
        embed_pure, embed_consts = jax.closure_convert(embed, inputs_b)
        y_example = jax.eval_shape(embed, inputs_b)
    with head_tracing:
        head_pure, head_consts = jax.closure_convert(head, y_example)

    def run(embed_consts, w, head_consts, trained):
        return _schedule(layers_fn, (embed_pure, embed_consts), inputs, w, side, (head_pure, head_consts), tail,
                         rows, ticks, tail_rules, trained, **kw)  # fmt: skip

    @jax.custom_vjp
    def scheduled(embed_consts, w, head_consts):
        return run(embed_consts, w, head_consts, None)[0]

    def scheduled_fwd(embed_consts, w, head_consts):
        # Only the layer weights that are differentiated (not a frozen base under LoRA) get a
        # backward and a gradient buffer.
        values = lambda tree: jax.tree.map(lambda p: p.value, tree)  # noqa: E731
        trained = [p.perturbed for p in jax.tree.leaves(w)]
        return run(values(embed_consts), values(w), values(head_consts), trained)

    def scheduled_bwd(grads, cotangents):
        g_loss = cotangents[0]
        g_embed, g_w, g_head = jax.tree.map(lambda g: (g_loss * g).astype(g.dtype), grads)
        # g_w: one entry per leaf of w, None (a zero) where it is not differentiated
        return g_embed, jax.tree.unflatten(jax.tree.structure(w), g_w), g_head

    scheduled.defvjp(scheduled_fwd, scheduled_bwd, symbolic_zeros=True)
    return scheduled(embed_consts, w, head_consts)


def _schedule(
    layers_fn, embedding, inputs, w, side, heading, tail, rows, ticks, tail_rules, trained, *, aux_loss,
    combine_stats, canonical, axes, res_spec, inner, mesh, constrain,
):  # fmt: skip
    S, M, R = ticks.stages, ticks.microbatches, ticks.repeats
    K = ticks.slots
    (embed_pure, embed_consts), (head_pure, head_consts) = embedding, heading
    B = jax.tree.leaves(inputs)[0].shape[0]
    b = B // M
    stage_S = jnp.arange(S)

    def microbatches(x_B):  # microbatch m: rows m, m + M, ... (as gradient accumulation splits)
        return x_B.reshape(b, M, *x_B.shape[1:]).swapaxes(0, 1)

    side_M = jax.tree.map(microbatches, side)
    rows_M = jax.tree.map(microbatches, rows)
    inputs_M = jax.tree.map(microbatches, inputs)

    def embed_rows(consts, m):
        """Microbatch m's input to the first stage."""
        with rules_replaced(tail_rules):
            x_bTD = embed_pure(jax.tree.map(lambda a: a[m], inputs_M), *consts)
        return constrain(x_bTD, res_spec)

    if ticks.diverge:
        with _region_tracing(_region_rules(inner, axes), axes, mesh):
            y_example = jax.eval_shape(
                lambda c: embed_pure(jax.tree.map(lambda a: a[0], inputs_M), *c), embed_consts
            )
    else:
        y_example = jax.eval_shape(embed_rows, embed_consts, 0)
    _, T, D = y_example.shape

    def tail_loss(consts, y_bTD, rows_b):
        with rules_replaced(tail_rules):
            return tail(head_pure(y_bTD, *consts), rows_b)

    w_leaves, w_def = jax.tree.flatten(w)
    trained = [False] * len(w_leaves) if trained is None else trained
    derived = types.SimpleNamespace(fn=None, depends=None, cut=None, stage_axes=None)  # set from shapes below

    def stage_fwd(x_bTD, w_c, side_b):
        """One chunk forward: (output, stats, residual leaves that are not the weights or side
        inputs); the pullback's structure and which of its leaves are those in `stage_fwd.layout`.
        The pullback gives the input's gradient and the trained weights'."""
        w_all = jax.tree.leaves(w_c)

        def f(x, w_trained):
            it = iter(w_trained)
            full = [next(it) if t else a for a, t in zip(w_all, trained, strict=True)]
            return layers_fn(x, jax.tree.unflatten(w_def, full), side_b)

        w_trained = [a for a, t in zip(w_all, trained, strict=True) if t]
        (out, stats), pullback = jax.vjp(f, x_bTD, w_trained)
        leaves, treedef = jax.tree.flatten(pullback)
        known = jax.tree.leaves((w_c, side_b))
        refs = [next((i for i, a in enumerate(known) if a is leaf), None) for leaf in leaves]
        stage_fwd.layout = treedef, refs
        return out, stats, [leaf for leaf, ref in zip(leaves, refs, strict=True) if ref is None]

    def stored_fwd(x_bTD, w_c, side_b):
        """stage_fwd keeping only the residuals that depend on the microbatch: those computed from
        the weights alone (the layer scan's per-layer slices of them, with remat none) are
        recomputed in the backward, not held once per microbatch in flight."""
        out, stats, leaves = stage_fwd(x_bTD, w_c, side_b)
        return out, stats, [leaf for leaf, dep in zip(leaves, derived.depends, strict=True) if dep]

    def per_stage_fwd(x_SbTD, w_S, side_S):
        with rules_replaced(inner):
            return jax.vmap(stored_fwd, spmd_axis_name=axes)(x_SbTD, w_S, side_S)

    def one(res, recomputed, w_c, side_b, g, g_stats):
        """One chunk's backward: (the input's gradient, the trained weights')."""
        treedef, refs = stage_fwd.layout
        known = jax.tree.leaves((w_c, side_b))
        stored, recomputed = iter(res), iter(recomputed)
        leaves = iter([next(stored) if dep else next(recomputed) for dep in derived.depends])
        leaves = [next(leaves) if ref is None else known[ref] for ref in refs]
        return jax.tree.unflatten(treedef, leaves)((g, g_stats))

    def per_stage_bwd(res_S, w_S, side_S, g_SbTD, g_stats_S):
        with rules_replaced(inner):
            # The weight-only residuals, from the stacked weights (outside the vmap: what it
            # traced, such as the dropless MoE's shard_map, already has the stage axis in it).
            recomputed_S = derived.fn(*jax.tree.leaves((w_S, side_S)))
            return jax.vmap(one, spmd_axis_name=axes)(res_S, recomputed_S, w_S, side_S, g_SbTD, g_stats_S)

    def per_stage_input_grad(res_S, w_S, side_S, g_SbTD, g_stats_S):
        """Split backward, B: (the input's gradient, what the weights' gradient will read)."""
        with rules_replaced(inner):
            recomputed_S = derived.fn(*jax.tree.leaves((w_S, side_S)))
            flat = jax.tree.leaves((res_S, recomputed_S, w_S, side_S, g_SbTD, g_stats_S))
            (g_in_SbTD,), saved = derived.cut.first(*flat)
            return g_in_SbTD, [
                jnp.moveaxis(a, ax, 0) for a, ax in zip(saved, derived.stage_axes, strict=True)
            ]

    def per_stage_weight_grad(res_S, w_S, side_S, saved_S):
        """Split backward, W: the trained weights' gradient."""
        with rules_replaced(inner):
            recomputed_S = derived.fn(*jax.tree.leaves((w_S, side_S)))
            given = jax.tree.leaves((res_S, recomputed_S, w_S, side_S))
            saved = [jnp.moveaxis(a, 0, ax) for a, ax in zip(saved_S, derived.stage_axes, strict=True)]
            return derived.cut.second(given, saved)

    def chunk_of(w, r_S):
        return jax.tree.map(lambda a: a[:, 0], w) if R == 1 else jax.vmap(
            lambda ws, r: jax.tree.map(lambda a: a[r], ws))(w, r_S)  # fmt: skip

    def rotate(x_S, shift):
        """Stage s's slice to stage s + shift (mod S): one collective-permute over the stage axes,
        named for the pass it serves (the dry-run counts each pass's ticks by them)."""
        perm = [(i, (i + shift) % S) for i in range(S)]

        @jax.shard_map(mesh=mesh, in_specs=PartitionSpec(axes), out_specs=PartitionSpec(axes),
                       axis_names=set(axes))  # fmt: skip
        def permute(x):
            return jax.lax.ppermute(x, axes, perm)

        with jax.named_scope(FORWARD_SCOPE if shift > 0 else BACKWARD_SCOPE):
            return permute(x_S)

    if ticks.diverge:
        return _diverged(
            ticks, stage_fwd, stored_fwd, one, derived, embed_rows_pure=(embed_pure, embed_consts),
            head=(head_pure, head_consts), tail=tail, w=w, trained=trained, inputs_M=inputs_M,
            side_M=side_M, rows_M=rows_M, y_example=y_example, aux_loss=aux_loss,
            combine_stats=combine_stats, canonical=canonical, axes=axes, res_spec=res_spec,
            inner=inner, mesh=mesh,
        )  # fmt: skip

    # Shapes of the residual ring, the statistics and their sums (one chunk of microbatch 0).
    w0 = chunk_of(w, jnp.zeros(S, jnp.int32))
    side0 = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (S, *a.shape[1:])), side_M)
    x0 = jnp.zeros((S, b, T, D), y_example.dtype)
    with rules_replaced(inner):
        derived.fn, derived.depends = weight_only(
            jax.vmap(stage_fwd, spmd_axis_name=axes), *jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x0, w0, side0))
        )  # fmt: skip
    _, stats0, res0 = jax.eval_shape(per_stage_fwd, x0, w0, side0)
    res_ring = [jnp.zeros((S, K, *r.shape[1:]), r.dtype) for r in res0]
    saved_ring = []
    if ticks.split:
        # The backward cut in two (split_backward.py), from the stages' pullback (traced over the
        # vmapped stages, as `weight_only` is, so what it traced has the stage axis in it).
        recomputed0 = jax.eval_shape(derived.fn, *jax.tree.leaves((w0, side0)))
        args = (res0, recomputed0, w0, side0, x0, stats0)
        flat_args, args_def = jax.tree.flatten(args)

        def flat_one(*flat):
            g_x, g_w = one(*jax.tree.unflatten(args_def, flat))
            return [g_x, *jax.tree.leaves(g_w)]

        with rules_replaced(inner):
            closed = jax.make_jaxpr(jax.vmap(flat_one, spmd_axis_name=axes))(*flat_args)
        n_given = len(jax.tree.leaves(args[:4]))
        later = [i < n_given for i in range(len(flat_args))]
        derived.cut = split_backward.split(closed, 1, later)
        # Where the stage axis is in each saved value (vmap puts it where each operation's
        # batching rule does): the one dimension that changes when the same cut is traced over
        # another number of stages.
        probe = S + 5
        probed = [jax.ShapeDtypeStruct((probe, *a.shape[1:]), a.dtype) for a in flat_args]
        with rules_replaced(inner):
            cut_probe = split_backward.split(jax.make_jaxpr(jax.vmap(flat_one))(*probed), 1, later)
        saved0 = jax.eval_shape(lambda *f: derived.cut.first(*f)[1], *flat_args)
        saved_probe = jax.eval_shape(lambda *f: cut_probe.first(*f)[1], *probed)
        derived.stage_axes = [split_backward.moved_axis(a.shape, b.shape, S, probe)
                              for a, b in zip(saved0, saved_probe, strict=True)]  # fmt: skip
        saved_ring = [jnp.zeros((S, S, *a.shape[:ax], *a.shape[ax + 1 :]), a.dtype)
                      for a, ax in zip(saved0, derived.stage_axes, strict=True)]  # fmt: skip
    stats_acc = jax.tree.map(lambda s: jnp.zeros((S, R, *s.shape[1:]), s.dtype), stats0)
    # The gradient of the (linear) auxiliary loss in each microbatch's statistics: a constant.
    stats_ct = None if stats0 is None else _aux_cotangent(aux_loss, combine_stats, canonical, M, stats_acc)

    tail_shapes = jax.eval_shape(tail_loss, head_consts, y_example, jax.tree.map(lambda a: a[0], rows_M))
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731
    stage_spec = PartitionSpec(axes, *res_spec)

    def add_grads(acc_list, g_w_S, r_S, valid_S):
        g_w_S = iter(g_w_S)
        return [
            None if acc is None else jax.vmap(
                lambda a, x, r, v: a.at[r].add(jnp.where(v, x, jnp.zeros_like(x))))(acc, next(g_w_S), r_S, valid_S)
            for acc in acc_list
        ]  # fmt: skip

    def body(carry, t, *, fwd: bool, bwd: bool, wgt: bool):
        c = dict(carry)
        if fwd:
            valid_S, m_S, r_S, k_S = ticks.forward(t, stage_S)
            first_bTD = embed_rows(embed_consts, jnp.clip(m_S[0], 0, M - 1))
            from_input_S = (stage_S == 0) & (r_S == 0)
            in_SbTD = _where(from_input_S, jnp.broadcast_to(first_bTD, c["state_f"].shape), c["state_f"])
            w_S = chunk_of(w, jnp.clip(r_S, 0, R - 1))
            side_S = jax.tree.map(lambda a: a[jnp.clip(m_S, 0, M - 1)], side_M)
            out_SbTD, stats_S, res_S = per_stage_fwd(in_SbTD, w_S, side_S)
            slot_S = jnp.mod(k_S, K)
            c["ring"] = [
                jax.vmap(lambda ring, x, i, v: jnp.where(v, ring.at[i].set(x), ring))(
                    ring, x, slot_S, valid_S
                )
                for ring, x in zip(c["ring"], res_S, strict=True)
            ]
            if stats_S is not None:
                c["stats"] = jax.tree.map(
                    lambda acc, s: jax.vmap(lambda a, x, r, v: a.at[r].add(jnp.where(v, x, jnp.zeros_like(x))))(
                        acc, s, jnp.clip(r_S, 0, R - 1), valid_S),
                    c["stats"], stats_S,
                )  # fmt: skip
            c["state_f"] = constrain(rotate(out_SbTD, 1), stage_spec)
        if bwd:
            # The loss of the microbatch leaving the last stage's last chunk in this tick.
            tail_valid, m_t, r_t, _ = ticks.forward(t, S - 1)
            tail_valid = tail_valid & (r_t == R - 1)
            m_t = jnp.clip(m_t, 0, M - 1)
            g_y = jnp.zeros((b, T, D), y_example.dtype)
            if fwd:
                y_bTD = out_SbTD[S - 1]
                rows_b = jax.tree.map(lambda a: a[m_t], rows_M)

                def live(y_bTD):
                    with jax.named_scope(TAIL_SCOPE):
                        (loss, sums), pull = jax.vjp(lambda h, y: tail_loss(h, y, rows_b), head_consts, y_bTD)
                        g_head, g_y = pull((jnp.ones_like(loss), zeros(sums)))
                    return loss, sums, g_head, g_y

                def idle(y_bTD):
                    return (jnp.zeros(tail_shapes[0].shape, tail_shapes[0].dtype), zeros(tail_shapes[1]),
                            zeros(head_consts), jnp.zeros_like(y_bTD))  # fmt: skip

                loss, sums, g_head, g_y = (
                    jax.lax.cond(tail_valid, live, idle, y_bTD) if R > 1 else live(y_bTD)
                )
                c["loss"] = c["loss"] + loss
                c["sums"] = jax.tree.map(jnp.add, c["sums"], sums)
                c["g_head"] = jax.tree.map(jnp.add, c["g_head"], g_head)
            valid_S, m_S, r_S, k_S = ticks.backward(t, stage_S)
            r_S = jnp.clip(r_S, 0, R - 1)
            from_loss_S = (stage_S == S - 1) & (r_S == R - 1)
            g_SbTD = _where(from_loss_S, jnp.broadcast_to(g_y, c["state_b"].shape), c["state_b"])
            slot_S = jnp.mod(k_S, K)
            res_S = [jax.vmap(lambda ring, i: ring[i])(ring, slot_S) for ring in c["ring"]]
            w_S = chunk_of(w, r_S)
            side_S = jax.tree.map(lambda a: a[jnp.clip(m_S, 0, M - 1)], side_M)
            g_stats_S = None if stats_ct is None else jax.tree.map(
                lambda ct: jax.vmap(lambda a, r: a[r])(ct, r_S), stats_ct)  # fmt: skip
            if ticks.split:
                g_in_SbTD, saved_S = per_stage_input_grad(res_S, w_S, side_S, g_SbTD, g_stats_S)
                # Slot: the microbatch's place in its group (k mod S), distinct over the S
                # backwards a stage runs before their weight passes.
                c["saved"] = [
                    jax.vmap(lambda ring, x, i, v: jnp.where(v, ring.at[i].set(x), ring))(ring, x, jnp.mod(k_S, S), valid_S)
                    for ring, x in zip(c["saved"], saved_S, strict=True)
                ]  # fmt: skip
            else:
                g_in_SbTD, g_w_S = per_stage_bwd(res_S, w_S, side_S, g_SbTD, g_stats_S)
                c["g_w"] = add_grads(c["g_w"], g_w_S, r_S, valid_S)
            # Stage 0's first chunk gives the gradient of the microbatch's embedding.
            m0 = jnp.clip(m_S[0], 0, M - 1)
            done = valid_S[0] & (r_S[0] == 0)

            def embed_grad(g_bTD):
                _, pull = jax.vjp(lambda consts: embed_rows(consts, m0), embed_consts)
                return pull(g_bTD)[0]

            g_embed = jax.lax.cond(done, embed_grad, lambda g: zeros(embed_consts), g_in_SbTD[0])
            c["g_embed"] = jax.tree.map(jnp.add, c["g_embed"], g_embed)
            c["state_b"] = constrain(rotate(g_in_SbTD, -1), stage_spec)
        if wgt:
            # Every stage's deferred weight gradient of the same microbatch chunk.
            valid, m, r, k = ticks.weight(t)
            m = jnp.clip(m, 0, M - 1)
            r_S = jnp.broadcast_to(jnp.clip(r, 0, R - 1), (S,))
            res_S = [ring[:, jnp.mod(k, K)] for ring in c["ring"]]
            saved_S = [ring[:, jnp.mod(k, S)] for ring in c["saved"]]
            side_S = jax.tree.map(lambda a: jnp.broadcast_to(a[m], (S, *a.shape[1:])), side_M)
            g_w_S = per_stage_weight_grad(res_S, chunk_of(w, r_S), side_S, saved_S)
            # The scope marks what runs once per weight pass and cannot be hoisted out of the tick
            # loop (the dry-run counts its runs): the sum into the gradient carry.
            with jax.named_scope(WEIGHT_SCOPE):
                c["g_w"] = add_grads(c["g_w"], g_w_S, r_S, jnp.broadcast_to(valid, (S,)))
        return c, None

    carry = {
        "state_f": constrain(jnp.zeros((S, b, T, D), y_example.dtype), stage_spec),
        "state_b": constrain(jnp.zeros((S, b, T, D), y_example.dtype), stage_spec),
        "ring": res_ring,
        "saved": saved_ring,
        "stats": stats_acc,
        "g_w": [jnp.zeros_like(a) if t else None for a, t in zip(w_leaves, trained, strict=True)],
        "g_embed": zeros(embed_consts),
        "loss": jnp.zeros(tail_shapes[0].shape, tail_shapes[0].dtype),
        "sums": zeros(tail_shapes[1]),
        "g_head": zeros(head_consts),
    }
    for start, stop, fwd, bwd, wgt in ticks.phases():
        if stop > start:
            carry, _ = jax.lax.scan(
                lambda c, t, fwd=fwd, bwd=bwd, wgt=wgt: body(c, t, fwd=fwd, bwd=bwd, wgt=wgt),
                carry, jnp.arange(start, stop),
            )  # fmt: skip
    stats = None if stats0 is None else combine_stats(canonical(carry["stats"]), M)
    loss = carry["loss"] + (aux_loss(stats) if stats is not None else 0.0)
    return (loss, carry["sums"], stats), (carry["g_embed"], carry["g_w"], carry["g_head"])


def _aux_cotangent(aux_loss, combine_stats, canonical, M, stats_acc):
    """The gradient of the (linear) auxiliary loss in the statistics' sums `stats_acc` (leaves
    (S, R, ...)): a constant, in their dtypes."""
    ct = jax.grad(lambda acc: aux_loss(combine_stats(canonical(acc), M)))(
        jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), stats_acc)
    )
    return jax.tree.map(lambda c, a: c.astype(a.dtype), ct, stats_acc)


def _region_rules(inner, axes):
    """The layers' rules inside a region manual over the stage axes: those axes left out."""
    return dataclasses.replace(
        inner,
        mapping={name: tuple(a for a in mapped if a not in axes) for name, mapped in inner.mapping.items()},
    )


@contextlib.contextmanager
def _region_tracing(rules, axes, mesh):
    """Tracing as inside `_diverged`'s region: its abstract mesh (the stage axes manual), under
    `rules` (which leave those axes out)."""
    region = mesh.abstract_mesh.update_axis_types({a: AxisType.Manual for a in axes})
    with jax.sharding.use_abstract_mesh(region), mesh_replaced(rules, region):
        yield


def _diverged(
    ticks, stage_fwd, stored_fwd, one, derived, *, embed_rows_pure, head, tail, w, trained, inputs_M,
    side_M, rows_M, y_example, aux_loss, combine_stats, canonical, axes, res_spec, inner, mesh,
):  # fmt: skip
    """1F1B or ZB-H1 with stages that diverge (diverging.py's tables): a `shard_map` manual over
    the stage axes, in which each tick every stage runs the pass its row of the table names, one
    `lax.switch` on it, and then sends what its forward made to the next stage and what its
    backward (or input-gradient pass) made to the previous one (two collective-permutes every
    stage runs). The passes are `_schedule`'s, traced once on one stage; the other mesh axes stay
    automatic inside.

    On XLA:CPU this needs the gloo collectives (a `jax.distributed` client, one process is
    enough): its in-process ones rendezvous over every device, so collectives that different
    stages reach in different branches wait for each other or exchange the wrong values."""
    S, M = ticks.stages, ticks.microbatches
    tab = ticks.table
    (embed_pure, embed_consts), (head_pure, head_consts) = embed_rows_pure, head
    b, T, D = y_example.shape
    K, Kw, Ki, Kc = tab.residual_slots, tab.saved_slots, tab.input_slots, tab.cotangent_slots
    region_rules = _region_rules(inner, axes)
    branch_of = ticks.branches()  # (S, T): the branch each stage runs at each tick
    split = ticks.split
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731
    spec_of = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731

    def get(ring, i):
        return jax.lax.dynamic_index_in_dim(ring, i, 0, keepdims=False)

    def put(ring, i, x):
        return jax.lax.dynamic_update_index_in_dim(ring, x.astype(ring.dtype), i, 0)

    def region(w_loc, embed_consts, head_consts, inputs_M, side_M, rows_M):
        s = jax.lax.axis_index(axes)
        amesh = jax.sharding.get_abstract_mesh()

        def constrain(x, spec):
            return jax.lax.with_sharding_constraint(x, NamedSharding(amesh, spec))

        with mesh_replaced(region_rules, amesh):
            w_c = jax.tree.map(lambda a: a[0, 0], w_loc)
            side0 = jax.tree.map(lambda a: a[0], side_M)
            x0 = jax.ShapeDtypeStruct((b, T, D), y_example.dtype)
            # Traced once here, run from their jaxprs in the branches (a pullback traced inside a
            # branch may hold other residuals than the one the rings were shaped from).
            derived.fn, derived.depends = weight_only(stage_fwd, x0, spec_of(w_c), spec_of(side0))
            fwd_closed, (out_s, stats_s, res_s) = jax.make_jaxpr(stored_fwd, return_shape=True)(
                x0, spec_of(w_c), spec_of(side0)
            )
            fwd_def = jax.tree.structure((out_s, stats_s, res_s))
            recomputed_s = jax.eval_shape(derived.fn, *jax.tree.leaves((spec_of(w_c), spec_of(side0))))
            args = (res_s, recomputed_s, spec_of(w_c), spec_of(side0), x0, stats_s)
            flat_args, args_def = jax.tree.flatten(args)

            def flat_one(*flat):
                g_x, g_w = one(*jax.tree.unflatten(args_def, flat))
                return [g_x, *jax.tree.leaves(g_w)]

            one_closed = jax.make_jaxpr(flat_one)(*flat_args)
            if split:
                n_given = len(jax.tree.leaves(args[:4]))
                cut = split_backward.split(one_closed, 1, [i < n_given for i in range(len(flat_args))])
                saved_s = jax.eval_shape(lambda *f: cut.first(*f)[1], *flat_args)
            else:
                saved_s = []
            stats_ct = None
            if stats_s is not None:  # this stage's share
                acc = jax.tree.map(lambda a: jax.ShapeDtypeStruct((S, 1, *a.shape), a.dtype), stats_s)
                stats_ct = jax.tree.map(
                    lambda c: c[s, 0], _aux_cotangent(aux_loss, combine_stats, canonical, M, acc)
                )

            def forward(x, w_c, side_b):
                flat = jax.tree.leaves((x, w_c, side_b))
                return jax.tree.unflatten(fwd_def, jax_core.jaxpr_as_fun(fwd_closed)(*flat))

            def embed(consts, m):
                return constrain(embed_pure(jax.tree.map(lambda a: get(a, m), inputs_M), *consts), res_spec)

            def forward_pass(place):
                def branch(c, m, w_c):
                    c = dict(c)
                    side_b = jax.tree.map(lambda a: get(a, m), side_M)
                    x = embed(embed_consts, m) if place == "first" else get(c["inputs"], m % Ki)
                    out, stats, res = forward(x, w_c, side_b)
                    c["res"] = [put(r, m % K, v) for r, v in zip(c["res"], res, strict=True)]
                    if stats is not None:
                        c["stats"] = jax.tree.map(jnp.add, c["stats"], stats)
                    if place == "last":
                        rows_b = jax.tree.map(lambda a: get(a, m), rows_M)
                        with jax.named_scope(TAIL_SCOPE):
                            (loss, sums), pull = jax.vjp(
                                lambda h, y: tail(head_pure(y, *h), rows_b), head_consts, out
                            )
                            g_head, g_y = pull((jnp.ones_like(loss), zeros(sums)))
                        c["loss"] = c["loss"] + loss
                        c["sums"] = jax.tree.map(jnp.add, c["sums"], sums)
                        c["g_head"] = jax.tree.map(jnp.add, c["g_head"], g_head)
                        c["cotangents"] = put(c["cotangents"], m % Kc, g_y)
                    else:
                        c["send_f"] = out.astype(c["send_f"].dtype)
                    return c

                return branch

            def input_grad_pass(place, whole=False):
                """B, or with `whole` B and W in one pass (1F1B's backward)."""

                def branch(c, m, w_c):
                    c = dict(c)
                    side_b = jax.tree.map(lambda a: get(a, m), side_M)
                    res = [get(r, m % K) for r in c["res"]]
                    recomputed = derived.fn(*jax.tree.leaves((w_c, side_b)))
                    g = get(c["cotangents"], m % Kc)
                    flat = jax.tree.leaves((res, recomputed, w_c, side_b, g, stats_ct))
                    if whole:
                        g_in, *g_w = jax_core.jaxpr_as_fun(one_closed)(*flat)
                        g_w = iter(g_w)
                        c["g_w"] = [None if acc is None else acc + next(g_w) for acc in c["g_w"]]
                    else:
                        (g_in,), saved = cut.first(*flat)
                        c["saved"] = [put(r, m % Kw, v) for r, v in zip(c["saved"], saved, strict=True)]
                    c["send_b"] = g_in.astype(c["send_b"].dtype)
                    if place == "first":
                        _, pull = jax.vjp(lambda consts: embed(consts, m), embed_consts)
                        c["g_embed"] = jax.tree.map(jnp.add, c["g_embed"], pull(g_in)[0])
                    return c

                return branch

            def weight_pass(c, m, w_c):
                c = dict(c)
                side_b = jax.tree.map(lambda a: get(a, m), side_M)
                res = [get(r, m % K) for r in c["res"]]
                recomputed = derived.fn(*jax.tree.leaves((w_c, side_b)))
                saved = [get(r, m % Kw) for r in c["saved"]]
                g_w = iter(cut.second(jax.tree.leaves((res, recomputed, w_c, side_b)), saved))
                c["g_w"] = [None if acc is None else acc + next(g_w) for acc in c["g_w"]]
                return c

            def scoped(name, fn):
                def run(c, m, w_c):
                    with jax.named_scope(name):
                        return fn(c, m, w_c)

                return run

            passes = {
                "forward_first": forward_pass("first"), "forward": forward_pass("middle"),
                "forward_last": forward_pass("last"), "input_grad_first": input_grad_pass("first"),
                "input_grad": input_grad_pass("middle"), "weight": weight_pass,
                "backward_first": input_grad_pass("first", whole=True),
                "backward": input_grad_pass("middle", whole=True),
                "idle": lambda c, m, w_c: c,
            }  # fmt: skip
            branches = [
                passes[name] if name == "idle" else scoped(PASS_SCOPE + name, passes[name])
                for name in ticks.branch_names()
            ]

            def act(shape):  # activations' rings and buffers: (..., b, T, D)
                return constrain(
                    jnp.zeros(shape, y_example.dtype), PartitionSpec(*[None] * (len(shape) - 3), *res_spec)
                )

            carry = {
                "inputs": act((Ki, b, T, D)),
                "cotangents": act((Kc, b, T, D)),
                "send_f": act((b, T, D)),
                "send_b": act((b, T, D)),
                "res": [jnp.zeros((K, *r.shape), r.dtype) for r in res_s],
                "saved": [jnp.zeros((Kw, *r.shape), r.dtype) for r in saved_s],
                "stats": zeros(stats_s),
                "g_w": [jnp.zeros_like(a) if t else None for a, t in zip(jax.tree.leaves(w_c), trained, strict=True)],
                "g_embed": zeros(embed_consts),
                "g_head": zeros(head_consts),
            }  # fmt: skip
            tail_s = jax.eval_shape(
                lambda h, y, r: tail(head_pure(y, *h), r),
                head_consts,
                out_s,
                jax.tree.map(lambda a: a[0], rows_M),
            )
            carry["loss"], carry["sums"] = zeros(tail_s)
            branch_T = jnp.asarray(branch_of)[s]
            micro_T = jnp.asarray(tab.microbatch)[s]
            arrives_f_T = jnp.asarray(tab.arrives_forward)[s]
            arrives_b_T = jnp.asarray(tab.arrives_backward)[s]

            def receive(ring, slots, m, x):
                i = jnp.maximum(m, 0) % slots
                return put(ring, i, jnp.where(m >= 0, x, get(ring, i)))

            def tick(c, t):
                c = jax.lax.switch(branch_T[t], branches, c, micro_T[t], w_c)
                with jax.named_scope(FORWARD_SCOPE):
                    from_prev = jax.lax.ppermute(c["send_f"], axes, [(i, i + 1) for i in range(S - 1)])
                with jax.named_scope(BACKWARD_SCOPE):
                    from_next = jax.lax.ppermute(c["send_b"], axes, [(i + 1, i) for i in range(S - 1)])
                c = dict(c)
                c["inputs"] = receive(c["inputs"], Ki, arrives_f_T[t], from_prev)
                c["cotangents"] = receive(c["cotangents"], Kc, arrives_b_T[t], from_next)
                return c, None

            c, _ = jax.lax.scan(tick, carry, jnp.arange(tab.ticks))
            # Stage 0 has the embedding's gradient and the last stage the head's and the loss.
            total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, axes), tree)  # noqa: E731
            g_w = [None if g is None else g[None, None] for g in c["g_w"]]
            stats = jax.tree.map(lambda a: a[None, None], c["stats"])
            return total(c["loss"]), total(c["sums"]), stats, total(c["g_embed"]), g_w, total(c["g_head"])

    stage, whole = PartitionSpec(axes), PartitionSpec()
    loss, sums, stats_acc, g_embed, g_w, g_head = jax.shard_map(
        region, mesh=mesh, in_specs=(stage, whole, whole, whole, whole, whole),
        out_specs=(whole, whole, stage, whole, stage, whole), axis_names=set(axes), check_vma=False,
    )(w, embed_consts, head_consts, inputs_M, side_M, rows_M)  # fmt: skip
    stats = None if stats_acc is None else combine_stats(canonical(stats_acc), M)
    loss = loss + (aux_loss(stats) if stats is not None else 0.0)
    return (loss, sums, stats), (g_embed, g_w, g_head)
