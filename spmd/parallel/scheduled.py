"""The pipeline's scheduled backward: 1F1B, interleaved 1F1B, ZB-H1, interleaved zero-bubble, and
GPipe and circular with `pipeline.backward = scheduled`, as one program over `stage` whose stages
diverge.

GPipe's and circular's lockstep loop (spmd/parallel/pipeline.py) gets its backward from autodiff
of the forward loop, so the backward starts after the last microbatch's forward, each stage keeps
what its remat policy saves for every microbatch, and every stage computes in every iteration.
Here the loss is part of the schedule: the output head and the loss run on each microbatch as it
leaves the last stage, and each stage runs the forwards and backwards of the microbatches in front
of it tick by tick (a per-stage `jax.vjp`, its residuals kept in a ring of slots until that
microbatch's backward comes round), so a stage holds what its table keeps in flight (a fixed
number of microbatch chunks whatever M is, but for GPipe's and circular's fill-and-drain, R M);
residuals computed from the weights alone are recomputed in the backward instead (`weight_only`). Stage 0 embeds each microbatch as it enters
and adds its embedding's gradient as its backward leaves, so nothing the size of the whole batch
is held either.

The stages diverge (`_diverged`): the step is a `shard_map` manual over the stage axes in which
each tick every stage runs the one pass its row of diverging.py's table names — a chunk's forward,
its whole backward, or (zero-bubble, `Ticks.split`) its input's gradient B or its weights' W, cut
apart by split_backward.py — or nothing, in one `lax.switch`; the passes are traced once on one
stage. An idle tick computes nothing.

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
import functools
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jax_core
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from spmd.core.logical import mesh_replaced
from spmd.parallel import diverging, split_backward

# The named scopes of the activations' and the gradients' moves between stages. Each tick a move
# runs only the pairs of stages the table has sending then: one conditional per direction over the
# sets of (from, to) pairs the table uses, the same set on every stage, each set's permute in the
# named scope of its direction's, "_", and its index in `Ticks.moves`.
FORWARD_SCOPE, BACKWARD_SCOPE = "pipeline_forward", "pipeline_backward"
# The named scope of the head and loss on the microbatch leaving the last virtual stage.
TAIL_SCOPE = "pipeline_tail"
# The named scope of each branch a tick's switch may have (the last is the idle one, with nothing
# in it), prefixed by PASS_SCOPE; a schedule's switch has those its table uses
# (`Ticks.branch_names`). First: stage 0's first chunk (the embedding); last: the last stage's last
# chunk (the head and loss).
PASS_SCOPE = "pipeline_pass_"
BRANCHES = ("forward_first", "forward", "forward_last", "input_grad_first", "input_grad", "weight",
            "backward_first", "backward", "idle")  # fmt: skip


class _Pass(NamedTuple):
    """A tick's pass on one stage: its microbatch, chunk, and the chunk's slot in each ring."""

    m: jax.Array
    r: jax.Array
    res: jax.Array
    saved: jax.Array
    inp: jax.Array
    cot: jax.Array


@dataclasses.dataclass(frozen=True)
class Ticks:
    """The tick plan of a scheduled pipeline: S stages, M microbatches, R chunks per stage."""

    stages: int
    microbatches: int
    repeats: int = 1
    # Zero-bubble (ZB-H1 with R = 1, interleaved with R > 1): each backward split into the input's
    # gradient (B) and the weights' (W), which fills ticks that would idle.
    split: bool = False
    # GPipe and circular: all forwards, then all backwards (whole).
    fill: bool = False

    @property
    def table(self) -> "diverging.Table":
        return diverging.table(self.stages, self.microbatches, self.split, self.repeats, self.fill)

    @property
    def total(self) -> int:
        return self.table.ticks

    @property
    def slots(self) -> int:
        """Residual slots per stage: the most microbatch chunks one stage holds between their
        forward and their backward (or weight pass)."""
        return self.table.residual_slots

    @functools.cached_property
    def _branch_table(self) -> np.ndarray:
        """(S, T): the index in BRANCHES of the branch stage s runs at tick t."""
        tab, S, R = self.table, self.stages, self.repeats
        by_kind = {diverging.FORWARD: "forward", diverging.INPUT_GRAD: "input_grad",
                   diverging.WEIGHT_GRAD: "weight", diverging.BACKWARD: "backward",
                   diverging.IDLE: "idle"}  # fmt: skip
        out = np.zeros(tab.kind.shape, np.int32)
        for s in range(S):
            for t, kind in enumerate(tab.kind[s]):
                name, r = by_kind[int(kind)], int(tab.chunk[s, t])
                if name in ("forward", "input_grad", "backward") and s == 0 and r == 0:
                    name += "_first"
                elif name == "forward" and s == S - 1 and r == R - 1:
                    name += "_last"
                out[s, t] = BRANCHES.index(name)
        return out

    def branch_names(self) -> tuple[str, ...]:
        """The branches of the tick's switch: those of BRANCHES the table uses, in its order (idle
        last)."""
        used = set(self._branch_table.ravel().tolist())
        return tuple(name for i, name in enumerate(BRANCHES) if i in used)

    def branches(self) -> np.ndarray:
        """(S, T): the index in `branch_names` of the branch stage s runs at tick t."""
        names = self.branch_names()
        index = np.asarray([names.index(n) if n in names else -1 for n in BRANCHES], np.int32)
        return index[self._branch_table]

    def moves(self, forward: bool) -> tuple[tuple[tuple[tuple[int, int], ...], ...], np.ndarray]:
        """The sets of (from, to) stage pairs that send in some tick, in the order of first use,
        and (T,) the index of each tick's set: forward, the stages whose F made a chunk's output
        for the next virtual stage; else those whose B (or whole backward) made a cotangent for
        the previous one. With R > 1 stage S - 1 sends on to stage 0, and stage 0 back to S - 1."""
        return self._moves[forward]

    @functools.cached_property
    def _moves(self) -> dict[bool, tuple]:
        return {forward: self._moves_of(forward) for forward in (True, False)}

    def _moves_of(self, forward: bool):
        tab, S, R = self.table, self.stages, self.repeats
        virtual = tab.chunk * S + np.arange(S)[:, None]
        if forward:
            sends, step = (tab.kind == diverging.FORWARD) & (virtual < R * S - 1), 1
        else:
            sends = np.isin(tab.kind, (diverging.INPUT_GRAD, diverging.BACKWARD)) & (virtual > 0)
            step = -1
        sets, index = [], np.zeros(tab.ticks, np.int32)
        for t in range(tab.ticks):
            pairs = tuple((int(s), int((s + step) % S)) for s in np.flatnonzero(sends[:, t]))
            if pairs not in sets:
                sets.append(pairs)
            index[t] = sets.index(pairs)
        return tuple(sets), index

    @functools.cached_property
    def branch_shares(self) -> dict[str, float]:
        """{named scope: share of the ticks that run it} for each branch with work in it of the
        tick's conditionals, which a count of the compiled step must weigh (`hlo.matmul_flops`,
        `hlo.collectives`): every device runs them T times. A pass's share is its runs over all
        stages' ticks (the count is then the mean over stages); a move's set of pairs, the same on
        every stage, its share of the ticks."""
        branches, names = self.branches(), self.branch_names()
        counts = np.bincount(branches.ravel(), minlength=len(names)) / branches.size
        out = {PASS_SCOPE + name: float(c) for name, c in zip(names, counts, strict=True) if name != "idle"}
        for scope, forward in ((FORWARD_SCOPE, True), (BACKWARD_SCOPE, False)):
            sets, index = self.moves(forward)
            shares = np.bincount(index, minlength=len(sets)) / len(index)
            out.update({f"{scope}_{i}": float(x) for i, (pairs, x) in enumerate(zip(sets, shares)) if pairs})
        return out

    @functools.cached_property
    def move_senders(self) -> dict[str, frozenset[int]]:
        """{named scope: the stages that send} of each move's set of pairs (`moves`), by the scope
        `branch_shares` names it with."""
        out = {}
        for scope, forward in ((FORWARD_SCOPE, True), (BACKWARD_SCOPE, False)):
            sets, _ = self.moves(forward)
            out.update(
                {f"{scope}_{i}": frozenset(a for a, _ in pairs) for i, pairs in enumerate(sets) if pairs}
            )
        return out


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


def loss(layers_fn, embed, inputs, w, side, *, head, tail, rows, ticks: Ticks, **kw):
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
    # The embedding and head run inside the region manual over the stage axes: traced for its mesh
    # and rules. The embedding's table is looked up whole there (gathered for each lookup, as FSDP
    # gathers a layer's weights): XLA's partitioner aborts on a lookup in a table split over the
    # automatic axes inside a region manual over others (a check on its device groups), whether
    # its rows or its columns are split.
    region = _region_rules(kw["inner"], kw["axes"])
    table_whole = dataclasses.replace(region, mapping={**region.mapping, "vocab": (), "embed": ()})
    with _region_tracing(table_whole, kw["axes"], kw["mesh"]):
        embed_pure, embed_consts = jax.closure_convert(embed, inputs_b)
        y_example = jax.eval_shape(embed, inputs_b)
    with _region_tracing(region, kw["axes"], kw["mesh"]):
        head_pure, head_consts = jax.closure_convert(head, y_example)

    def run(embed_consts, w, head_consts, trained):
        return _schedule(layers_fn, (embed_pure, embed_consts), inputs, w, side, (head_pure, head_consts), tail,
                         rows, ticks, trained, **kw)  # fmt: skip

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
    layers_fn, embedding, inputs, w, side, heading, tail, rows, ticks, trained, *, aux_loss, combine_stats,
    canonical, axes, res_spec, inner, mesh,
):  # fmt: skip
    M = ticks.microbatches
    (embed_pure, embed_consts), (head_pure, head_consts) = embedding, heading
    B = jax.tree.leaves(inputs)[0].shape[0]
    b = B // M

    def microbatches(x_B):  # microbatch m: rows m, m + M, ... (as gradient accumulation splits)
        return x_B.reshape(b, M, *x_B.shape[1:]).swapaxes(0, 1)

    side_M = jax.tree.map(microbatches, side)
    rows_M = jax.tree.map(microbatches, rows)
    inputs_M = jax.tree.map(microbatches, inputs)
    with _region_tracing(_region_rules(inner, axes), axes, mesh):
        y_example = jax.eval_shape(
            lambda c: embed_pure(jax.tree.map(lambda a: a[0], inputs_M), *c), embed_consts
        )

    w_leaves, w_def = jax.tree.flatten(w)
    trained = [False] * len(w_leaves) if trained is None else trained
    derived = types.SimpleNamespace(fn=None, depends=None)  # set from shapes in the region

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

    def one(res, recomputed, w_c, side_b, g, g_stats):
        """One chunk's backward: (the input's gradient, the trained weights')."""
        treedef, refs = stage_fwd.layout
        known = jax.tree.leaves((w_c, side_b))
        stored, recomputed = iter(res), iter(recomputed)
        leaves = iter([next(stored) if dep else next(recomputed) for dep in derived.depends])
        leaves = [next(leaves) if ref is None else known[ref] for ref in refs]
        return jax.tree.unflatten(treedef, leaves)((g, g_stats))

    return _diverged(
        ticks, stage_fwd, stored_fwd, one, derived, embed_rows_pure=(embed_pure, embed_consts),
        head=(head_pure, head_consts), tail=tail, w=w, trained=trained, inputs_M=inputs_M,
        side_M=side_M, rows_M=rows_M, y_example=y_example, aux_loss=aux_loss,
        combine_stats=combine_stats, canonical=canonical, axes=axes, res_spec=res_spec,
        inner=inner, mesh=mesh,
    )  # fmt: skip


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
    """The schedule with stages that diverge (diverging.py's tables): a `shard_map` manual over the
    stage axes, in which each tick every stage runs the pass its row of the table names, one
    `lax.switch` on it, and then sends what its forward made to the next virtual stage and what its
    backward (or input-gradient pass) made to the previous one (per direction one `lax.switch` over
    the sets of stage pairs that send in some tick, the same branch on every stage: a
    collective-permute of the pairs sending this tick, or nothing; with R > 1 stage S - 1 sends to
    stage 0 and back). The passes are `_schedule`'s, traced once on one stage; the other mesh axes
    stay automatic inside. Each tick's pass reads its chunk's weights (the stage holds R) and its
    chunk's slot in each ring from the table.

    On XLA:CPU this needs the gloo collectives (a `jax.distributed` client, one process is
    enough): its in-process ones rendezvous over every device, so collectives that different
    stages reach in different branches wait for each other or exchange the wrong values."""
    S, M, R = ticks.stages, ticks.microbatches, ticks.repeats
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
            if stats_s is not None:  # this stage's share, per chunk
                acc = jax.tree.map(lambda a: jax.ShapeDtypeStruct((S, R, *a.shape), a.dtype), stats_s)
                stats_ct = jax.tree.map(
                    lambda c: c[s], _aux_cotangent(aux_loss, combine_stats, canonical, M, acc)
                )

            def forward(x, w_c, side_b):
                flat = jax.tree.leaves((x, w_c, side_b))
                return jax.tree.unflatten(fwd_def, jax_core.jaxpr_as_fun(fwd_closed)(*flat))

            def add_at(acc, r, x):  # acc[r] += x
                return put(acc, r, get(acc, r) + x.astype(acc.dtype))

            def embed(consts, m):
                return constrain(embed_pure(jax.tree.map(lambda a: get(a, m), inputs_M), *consts), res_spec)

            def forward_pass(place):
                def branch(c, p, w_c):
                    c, m = dict(c), p.m
                    side_b = jax.tree.map(lambda a: get(a, m), side_M)
                    x = embed(embed_consts, m) if place == "first" else get(c["inputs"], p.inp)
                    out, stats, res = forward(x, w_c, side_b)
                    c["res"] = [put(r, p.res, v) for r, v in zip(c["res"], res, strict=True)]
                    if stats is not None:
                        c["stats"] = jax.tree.map(lambda a, x: add_at(a, p.r, x), c["stats"], stats)
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
                        c["cotangents"] = put(c["cotangents"], p.cot, g_y)
                    else:
                        c["send_f"] = out.astype(c["send_f"].dtype)
                    return c

                return branch

            def input_grad_pass(place, whole=False):
                """B, or with `whole` B and W in one pass (1F1B's backward)."""

                def branch(c, p, w_c):
                    c, m = dict(c), p.m
                    side_b = jax.tree.map(lambda a: get(a, m), side_M)
                    res = [get(r, p.res) for r in c["res"]]
                    recomputed = derived.fn(*jax.tree.leaves((w_c, side_b)))
                    g = get(c["cotangents"], p.cot)
                    g_stats = None if stats_ct is None else jax.tree.map(lambda a: get(a, p.r), stats_ct)
                    flat = jax.tree.leaves((res, recomputed, w_c, side_b, g, g_stats))
                    if whole:
                        g_in, *g_w = jax_core.jaxpr_as_fun(one_closed)(*flat)
                        g_w = iter(g_w)
                        c["g_w"] = [None if acc is None else add_at(acc, p.r, next(g_w)) for acc in c["g_w"]]
                    else:
                        (g_in,), saved = cut.first(*flat)
                        c["saved"] = [put(r, p.saved, v) for r, v in zip(c["saved"], saved, strict=True)]
                    c["send_b"] = g_in.astype(c["send_b"].dtype)
                    if place == "first":
                        _, pull = jax.vjp(lambda consts: embed(consts, m), embed_consts)
                        c["g_embed"] = jax.tree.map(jnp.add, c["g_embed"], pull(g_in)[0])
                    return c

                return branch

            def weight_pass(c, p, w_c):
                c = dict(c)
                side_b = jax.tree.map(lambda a: get(a, p.m), side_M)
                res = [get(r, p.res) for r in c["res"]]
                recomputed = derived.fn(*jax.tree.leaves((w_c, side_b)))
                saved = [get(r, p.saved) for r in c["saved"]]
                g_w = iter(cut.second(jax.tree.leaves((res, recomputed, w_c, side_b)), saved))
                c["g_w"] = [None if acc is None else add_at(acc, p.r, next(g_w)) for acc in c["g_w"]]
                return c

            def scoped(name, fn):
                def run(c, p, w_c):
                    with jax.named_scope(name):
                        return fn(c, p, w_c)

                return run

            passes = {
                "forward_first": forward_pass("first"), "forward": forward_pass("middle"),
                "forward_last": forward_pass("last"), "input_grad_first": input_grad_pass("first"),
                "input_grad": input_grad_pass("middle"), "weight": weight_pass,
                "backward_first": input_grad_pass("first", whole=True),
                "backward": input_grad_pass("middle", whole=True),
                "idle": lambda c, p, w_c: c,
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
                # per chunk: (R, ...)
                "stats": jax.tree.map(lambda a: jnp.zeros((R, *a.shape), a.dtype), stats_s),
                "g_w": [jnp.zeros_like(a[0]) if t else None for a, t in zip(jax.tree.leaves(w_loc), trained, strict=True)],
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
            pass_T = _Pass(*(jnp.asarray(a)[s] for a in (tab.microbatch, tab.chunk, tab.residual_slot,
                                                          tab.saved_slot, tab.input_slot, tab.cotangent_slot)))  # fmt: skip

            # The sends: to the next (previous) virtual stage, from the stages that made something
            # for it this tick (`Ticks.moves`).
            def mover(scope, forward):
                sets, index = ticks.moves(forward)

                def move(i, pairs):
                    def run(x):
                        if not pairs:
                            return jnp.zeros_like(x)
                        with jax.named_scope(f"{scope}_{i}"):
                            return jax.lax.ppermute(x, axes, list(pairs))

                    return run

                return [move(i, pairs) for i, pairs in enumerate(sets)], jnp.asarray(index)

            (forward_moves, forward_T), (backward_moves, backward_T) = (
                mover(FORWARD_SCOPE, True),
                mover(BACKWARD_SCOPE, False),
            )

            def weights(r):
                if R == 1:
                    return jax.tree.map(lambda a: a[0, 0], w_loc)
                return jax.tree.map(lambda a: get(a[0], r), w_loc)

            arrives_f_T = jnp.asarray(tab.arrives_forward)[s]
            arrives_b_T = jnp.asarray(tab.arrives_backward)[s]

            def receive(ring, slot, x):  # slot: the table's, or -1 when nothing arrives
                i = jnp.maximum(slot, 0)
                return put(ring, i, jnp.where(slot >= 0, x, get(ring, i)))

            def tick(c, t):
                p = _Pass(*(a[t] for a in pass_T))
                c = jax.lax.switch(branch_T[t], branches, c, p, weights(p.r))
                with jax.named_scope(FORWARD_SCOPE):
                    from_prev = jax.lax.switch(forward_T[t], forward_moves, c["send_f"])
                with jax.named_scope(BACKWARD_SCOPE):
                    from_next = jax.lax.switch(backward_T[t], backward_moves, c["send_b"])
                c = dict(c)
                c["inputs"] = receive(c["inputs"], arrives_f_T[t], from_prev)
                c["cotangents"] = receive(c["cotangents"], arrives_b_T[t], from_next)
                return c, None

            c, _ = jax.lax.scan(tick, carry, jnp.arange(tab.ticks))
            # Stage 0 has the embedding's gradient and the last stage the head's and the loss.
            total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, axes), tree)  # noqa: E731
            g_w = [None if g is None else g[None] for g in c["g_w"]]
            stats = jax.tree.map(lambda a: a[None], c["stats"])
            return total(c["loss"]), total(c["sums"]), stats, total(c["g_embed"]), g_w, total(c["g_head"])

    stage, whole = PartitionSpec(axes), PartitionSpec()
    loss, sums, stats_acc, g_embed, g_w, g_head = jax.shard_map(
        region, mesh=mesh, in_specs=(stage, whole, whole, whole, whole, whole),
        out_specs=(whole, whole, stage, whole, stage, whole), axis_names=set(axes), check_vma=False,
    )(w, embed_consts, head_consts, inputs_M, side_M, rows_M)  # fmt: skip
    stats = None if stats_acc is None else combine_stats(canonical(stats_acc), M)
    loss = loss + (aux_loss(stats) if stats is not None else 0.0)
    return (loss, sums, stats), (g_embed, g_w, g_head)
