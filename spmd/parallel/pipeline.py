"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular (interleaved) schedules
here; 1F1B, interleaved 1F1B, ZB-H1 and interleaved zero-bubble, whose backward runs inside the
schedule, in scheduled.py.

GSPMD style, as MaxText does it: the compiler sees one program. The layer stack (a leading
`layers` axis, which the rules map to `stage`) is viewed as (S stages, R repeats, Gps groups per
stage); every iteration all S stages run at once as one `vmap` over the stage axis
(`spmd_axis_name`, so every constraint inside the layers keeps the stage split), each on the
microbatch in front of it, and the activations move to the next stage by a rotation of the
stage-split array, which the partitioner compiles to a collective-permute. Autodiff runs the
same schedule backwards (the transpose of a collective-permute is the reverse permute), with
the model's remat policy inside each stage. (The scheduled pipelines run their stages apart
instead, in a region manual over `stage` whose layers see the same rules: scheduled.py.)

That lockstep loop computes every stage in every iteration, the idle ones on zeros: its FLOPs are
the model's / (1 - bubble). Where the stages' collectives may run apart (accelerators; XLA:CPU
with the gloo collectives) and the objective is the language-model loss, GPipe and circular run
in scheduled.py too by default (`pipeline.backward = auto`): each stage all its forwards, then all
its backwards, an idle tick computing nothing (diverging.py's fill-and-drain tables). The lockstep
loop stays for the rest: preference objectives, whose loss pairs sequences outside the pipeline,
and XLA:CPU in one process without gloo, whose collectives must be reached by every device alike.
It is also the pipeline's forward when there is no backward (evaluation).

Schedule (S stages, M microbatches, R repeats; M >= S): microbatch m visits virtual stage
v = r*S + s (canonical layer groups v*Gps ... v*Gps + Gps - 1) at iteration r*M + m + s, so the
pipeline runs M*R + S - 1 iterations of which each stage idles S - 1: the bubble fraction is
(S - 1) / (M*R + S - 1). GPipe is R = 1. With R > 1 stage s holds the non-adjacent groups
v = s, S + s, 2S + s, ...: the stored layer stack is permuted (`layer_order`) so that the
contiguous split over `stage` gives each stage its groups; checkpoints hold the canonical order
(`to_canonical` / `from_canonical`), so they move between any stage count, repeats or no pipeline.

A microbatch's output from the last stage reaches stage 0 by the same rotation; stage 0 keeps it
in a buffer (one slot per microbatch, which first holds the inputs) until its next repeat, and
after the last repeat the buffer holds the outputs. The embedding, the output head and the loss
run outside the pipeline; the pp presets split their rows over `stage` too (`batch` includes it,
innermost), so each stage runs them on its share: stage 0 gathers the rows in (one all-gather)
and hands each stage its outputs back. Inside the pipeline the layers see the rules with the stage
axes taken out of every name but `layers` (`layer_rules`): there the vmapped dimension is stage.

Legend: S stages, R repeats, G layer groups (Gps = G / (S R) per stage and repeat), M
microbatches, b rows per microbatch, T sequence, D embed.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spmd.core.errors import UserError
from spmd.core.logical import active, rules_replaced
from spmd.core.mesh import axes_size, spec_axes
from spmd.parallel import scheduled
from spmd.parallel.strategy import Attribution, Strategy, rule, squeeze
from spmd.platform import distributed

STAGE_AXIS = "stage"

PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb")
# Schedules whose backward is scheduled with the forward (spmd/parallel/scheduled.py), their stages
# running different passes in the same tick; the others get theirs from autodiff of the forward
# loop, every stage on the same pass.
SCHEDULED = ("1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb")
# Scheduled with each backward split into the input's and the weights' gradient (zero-bubble).
SPLIT = ("zb_h1", "interleaved_zb")
WITH_REPEATS = ("circular", "interleaved_1f1b", "interleaved_zb")
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")
# pipeline.backward: how GPipe and circular get theirs (module doc)
BACKWARDS = ("auto", "scheduled", "autodiff")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The `[pipeline]` table: used when the rules map `layers` to `stage` and the mesh has
    stage > 1."""

    microbatches: int = 0  # pipeline microbatches per (gradient-accumulation) batch; 0: one per stage
    schedule: str = "gpipe"  # gpipe | circular | 1f1b | interleaved_1f1b | zb_h1 | interleaved_zb
    # circular, interleaved_1f1b, interleaved_zb: layer groups (chunks) per stage, visited
    # round-robin (divides the bubble)
    repeats: int = 1
    # FSDP inside a stage: gather the stage's weights once per step before the schedule (and
    # reduce their gradients once after it) instead of in every pipeline iteration. Fewer bytes
    # sent; the stage's weights and their gradient sums are held unsharded over fsdp meanwhile.
    gather_once: bool = False
    # gpipe, circular: "scheduled" (each stage its forwards, then its backwards, an idle tick
    # computing nothing; needs stages whose collectives may diverge and the lm objective),
    # "autodiff" (the lockstep loop: every stage computes every iteration), "auto" (scheduled
    # where it can run). The other schedules always schedule theirs.
    backward: str = "auto"

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
        elif self.repeats > 1 and self.schedule not in WITH_REPEATS:
            problems.append(
                f"pipeline.repeats = {self.repeats} needs pipeline.schedule = circular, "
                f"interleaved_1f1b or interleaved_zb ({self.schedule} holds one layer group per stage)"
            )
        elif self.schedule in INTERLEAVED and self.repeats < 2:
            one = "zb_h1" if self.schedule == "interleaved_zb" else "1f1b"
            problems.append(
                f"pipeline.schedule = {self.schedule} needs pipeline.repeats >= 2 (with one chunk per "
                f"stage it is {one})"
            )
        if self.backward not in BACKWARDS:
            problems.append(f"pipeline.backward must be one of {', '.join(BACKWARDS)}, got {self.backward!r}")
        elif self.backward == "autodiff" and self.schedule in SCHEDULED:
            problems.append(
                f"pipeline.backward = autodiff needs pipeline.schedule = gpipe or circular "
                f"({self.schedule} schedules its backward); use pipeline.backward = auto"
            )
        return problems


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule on a mesh: S stages (the mesh axes `layers` maps to), M microbatches,
    R repeats."""

    stages: int
    microbatches: int
    repeats: int = 1
    axes: tuple[str, ...] = (STAGE_AXIS,)
    gather_once: bool = False  # FSDP: weights gathered once per step, not per iteration
    kind: str = ""  # the configured schedule; "" reads as gpipe or circular from `repeats`
    # GPipe, circular: the lockstep loop and autodiff's backward, or (False) scheduled.py's
    # fill-and-drain table (`pipeline.backward`)
    lockstep: bool = True

    @property
    def name(self) -> str:
        return self.kind or ("circular" if self.repeats > 1 else "gpipe")

    @property
    def setting(self) -> str:
        """The configured schedule as a user writes it: its name, and for GPipe and circular with
        their backward scheduled, that key too."""
        return (
            self.name
            if self.lockstep or self.name in SCHEDULED
            else f"{self.name} with pipeline.backward=scheduled"
        )

    @property
    def scheduled(self) -> bool:
        """Whether the backward runs inside the schedule (spmd/parallel/scheduled.py)."""
        return self.name in SCHEDULED or not self.lockstep

    @functools.cached_property
    def ticks(self) -> "scheduled.Ticks":
        """The tick plan of a scheduled backward (kept: its moves and branch shares are computed
        once)."""
        fill = self.name not in SCHEDULED
        return scheduled.Ticks(self.stages, self.microbatches, self.repeats, split=self.split, fill=fill)

    @property
    def split(self) -> bool:
        """Whether each backward is split into the input's and the weights' gradient (zb_h1,
        interleaved_zb)."""
        return self.name in SPLIT

    @property
    def iterations(self) -> int:
        """The lockstep loop's forward iterations (GPipe, circular), or a scheduled backward's ticks
        (each a pass of every stage)."""
        if self.scheduled:
            return self.ticks.total
        return self.forward_iterations

    @property
    def forward_iterations(self) -> int:
        """Iterations of the lockstep forward loop (`run`): M R + S - 1."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Share of each stage's pass slots spent idle, a forward, an input-gradient and a
        weight-gradient pass (of a chunk) costing alike: (S - 1) / (M R + S - 1) for the schedules
        with whole backwards (GPipe and circular, lockstep or scheduled; 1F1B and interleaved
        1F1B, whose stages run one pass each per tick, F or a whole backward, in 2 (M R + S - 1)
        ticks), (S - 1) / (3 M R + S - 1) for the zero-bubble ones (F, B or W each tick, in
        3 M R + S - 1; diverging.py)."""
        S, M, R = self.stages, self.microbatches, self.repeats
        if self.split:
            return (S - 1) / (3 * M * R + S - 1)
        return (S - 1) / (M * R + S - 1)

    @property
    def bubble_formula(self) -> str:
        """`bubble_fraction` in S, M and R."""
        return "(S-1)/(3M*R+S-1)" if self.split else "(S-1)/(M*R+S-1)"

    @property
    def in_flight(self) -> int:
        """Microbatch chunks whose saved activations a stage holds at once, at most: all under
        autodiff of the lockstep loop (which saves them for every iteration, idle ones included:
        M R + S - 1), the residual slots of scheduled.py otherwise (R M for GPipe's and circular's
        fill-and-drain)."""
        if self.scheduled:
            return self.ticks.slots
        return self.iterations

    def describe(self) -> str:
        r = f", {self.repeats} repeats" if self.repeats > 1 else ""
        if self.name not in SCHEDULED:
            r += ", lockstep" if self.lockstep else ", scheduled backward"
        return (
            f"{self.name} over {self.stages} stages, {self.microbatches} microbatches{r}: "
            f"bubble {self.bubble_fraction:.1%} ({self.bubble_formula}), {self.in_flight} microbatch "
            f"chunks in flight per stage"
        )


def schedule_for(
    pcfg: PipelineConfig | None, mesh, rules, groups: int, batch: int, n_layers: int, objective: str = "lm"
) -> Schedule | None:
    """The run's schedule from `pcfg` ([pipeline]), or None when the mesh has no pipeline
    (`layers` split over nothing of size > 1). `groups`: the layer groups the model scans over;
    `batch`: sequences per (gradient-accumulation) microbatch; `objective`: train.objective.
    Bad combinations raise UserError."""
    layer_axes = tuple(rules.mapping.get("layers", ()))
    stage_size = mesh.shape.get(STAGE_AXIS, 1)
    split = tuple(a for a in layer_axes if mesh.shape[a] > 1)
    used = {a for axes in rules.mapping.values() for a in axes}
    if stage_size > 1 and STAGE_AXIS not in used:
        raise UserError(
            f"the mesh has stage={stage_size} but rules {rules.name!r} do not map the logical axis "
            f"`layers` to it; use a pipeline preset (pp, pp_fsdp, pp_fsdp_tp, pp_fsdp_tp_sp) or add "
            f'`layers = "stage"` to the rules'
        )
    if not split:
        return None
    if split != (STAGE_AXIS,):
        raise UserError(
            f"rules {rules.name!r} map `layers` to {', '.join(split)}; only the `stage` mesh axis can "
            f'split the layer stack (pipeline parallelism): use `layers = "stage"`'
        )
    pcfg = pcfg or PipelineConfig()
    S, R = axes_size(mesh.shape, split), pcfg.repeats
    M = pcfg.microbatches or S
    if M < S:
        raise UserError(
            f"pipeline.microbatches ({M}) must be at least the number of stages ({S}): with fewer, "
            f"stages would wait on each other's outputs; raise pipeline.microbatches"
        )
    if groups % (S * R):
        per = f" ({groups} groups of {n_layers // groups} layers)" if groups != n_layers else ""
        raise UserError(
            f"model.n_layers ({n_layers}{per}) does not divide into {S} stages x {R} repeats "
            f"= {S * R} equal parts; change model.n_layers, the stage axis or pipeline.repeats"
        )
    dp = axes_size(mesh.shape, [a for a in rules.mapping.get("batch", ()) if a not in split])
    if batch % M or (batch // M) % dp:
        raise UserError(
            f"the batch of {batch} sequences per step (train.global_batch_size / train.microbatches) "
            f"does not split into {M} pipeline microbatches of a multiple of {dp} (the batch's mesh "
            f"axes); make it a multiple of {M * dp}, or change pipeline.microbatches"
        )
    if pcfg.schedule in INTERLEAVED and M % S:
        raise UserError(
            f"pipeline.schedule = {pcfg.schedule} runs microbatches in groups of the {S} stages: "
            f"pipeline.microbatches ({M}) must be a multiple of {S}"
        )
    lockstep = pcfg.schedule not in SCHEDULED and (
        pcfg.backward == "autodiff"
        or pcfg.backward == "auto"
        and not (objective == "lm" and distributed.collectives_may_diverge(list(mesh.devices.flat)))
    )
    return Schedule(S, M, R, split, pcfg.gather_once, pcfg.schedule, lockstep)


def layer_order(groups: int, schedule: Schedule | None) -> np.ndarray | None:
    """`order[i]`: the canonical layer group stored at position i of the layer stack, or None when
    stored order is canonical (no pipeline, or GPipe). Stage s (positions s*R*Gps ...) holds, for
    each repeat r, the groups (r*S + s)*Gps ... + Gps - 1."""
    if schedule is None or schedule.repeats == 1:
        return None
    S, R = schedule.stages, schedule.repeats
    return np.arange(groups).reshape(R, S, groups // (S * R)).transpose(1, 0, 2).reshape(-1)


def permute_leading(x, order: np.ndarray):
    """`x` with the layer groups of its leading axis (len(order) groups of equal rows) taken in
    `order`."""
    G = len(order)
    grouped = x.reshape(G, x.shape[0] // G, *x.shape[1:])
    return jnp.take(grouped, jnp.asarray(order), axis=0).reshape(x.shape)


def layer_rules(rules, schedule: Schedule):
    """`rules` as the layers inside the pipeline see them: the stage axes split only the stack."""
    mapping = {
        name: tuple(a for a in axes if a not in schedule.axes) if name != "layers" else axes
        for name, axes in rules.mapping.items()
    }
    return dataclasses.replace(rules, mapping=mapping)


def stage_weights(xs, xs_axes, schedule: Schedule, rules, constrain):
    """The layer stack's leaves (G, ...) as (S, R, Gps, ...): contiguous blocks, so the split over
    `stage` stays where it is; with `gather_once`, unsplit over the batch (FSDP) axes."""
    S, R = schedule.stages, schedule.repeats
    G = jax.tree.leaves(xs)[0].shape[0]
    Gps = G // (S * R)
    stage = schedule.axes[0] if len(schedule.axes) == 1 else schedule.axes  # a PartitionSpec entry
    w = jax.tree.map(
        lambda a: constrain(
            a.reshape(S, R, Gps, *a.shape[1:]),
            PartitionSpec(stage, *[PartitionSpec.UNCONSTRAINED] * (a.ndim + 1)),
        ),
        xs,
    )

    if schedule.gather_once and xs_axes is not None:
        # The stage's weights unsplit over the batch (FSDP) axes for the whole schedule: one
        # gather here, and in the backward one reduction of their summed gradients.
        batch_axes = set(rules.mapping.get("batch", ()))

        def gathered(a, logical):
            entries = [tuple(x for x in spec_axes(e) if x not in batch_axes) for e in rules.spec(logical[1:])]
            rest = [None if not e else e[0] if len(e) == 1 else e for e in entries]
            return constrain(a, PartitionSpec(stage, None, None, *rest))

        leaves, treedef = jax.tree.flatten(w)
        w = jax.tree.unflatten(treedef, [gathered(a, axes) for a, axes in zip(leaves, xs_axes, strict=True)])

    return w


def run(layers_fn, x_BTD, xs, side, *, x_axes, xs_axes=None, combine_stats=None, schedule: Schedule):
    """The layer stack `xs` (leaves with a leading axis of G groups, stored as `layer_order` says)
    applied to `x_BTD` by the pipeline schedule. `layers_fn(x_bTD, xs_rows, side_rows)` runs some
    consecutive groups on some rows and returns (x, stats stacked over the groups or None);
    `side`: per-row inputs of the layers (positions, segment ids; leading axis B, or None);
    `x_axes`: the residual's logical axes; `xs_axes`: each leaf's of `xs`, in
    jax.tree.leaves order (needed by `gather_once`); `combine_stats(sums, M)`: the stats of the whole batch
    from their sums over M microbatches. Returns (x_BTD, stats stacked over all G groups in
    canonical order) like a scan over the stack would."""
    rules, mesh = active()
    S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
    B, T, D = x_BTD.shape
    b = B // M
    G = jax.tree.leaves(xs)[0].shape[0]

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    stage = schedule.axes[0] if len(schedule.axes) == 1 else schedule.axes  # a PartitionSpec entry
    # Outside the pipeline the batch may be split over the stage axes too (the embedding, head and
    # loss then split their rows over the stages); inside, each stage holds its microbatch's rows.
    inner = layer_rules(rules, schedule)
    res_spec = inner.spec(x_axes)  # (batch, seq, embed) of the residual inside the pipeline
    x_BTD = constrain(x_BTD, res_spec)  # rows from every stage to all of them (one gather)

    w = stage_weights(xs, xs_axes, schedule, rules, constrain)

    # Microbatch m takes rows m, m + M, m + 2M, ... (as gradient accumulation splits): the reshape
    # keeps each device's rows on that device.
    def microbatches(x_B):
        return x_B.reshape(b, M, *x_B.shape[1:]).swapaxes(0, 1)

    x_MbTD = microbatches(x_BTD)
    side_M = jax.tree.map(microbatches, side)
    # Stage 0's buffer, one slot per microbatch: the inputs, then each repeat's last-stage output.
    buf_SMbTD = constrain(
        jnp.broadcast_to(x_MbTD[None], (S, *x_MbTD.shape)), PartitionSpec(stage, None, *res_spec)
    )
    state_SbTD = constrain(jnp.zeros((S, b, T, D), x_BTD.dtype), PartitionSpec(stage, *res_spec))
    stage_S = jnp.arange(S)

    perm = [(i, (i + 1) % S) for i in range(S)]

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=PartitionSpec(stage),
        out_specs=PartitionSpec(stage),
        axis_names=set(schedule.axes),
    )
    def rotate(x_SbTD):
        """Stage s's slice to stage s + 1 (mod S): one collective-permute over the stage axes only
        (written out because the partitioner, left to rotate a split array, sent the gradient
        twice), whose transpose is the reverse permute."""
        return jax.lax.ppermute(x_SbTD, schedule.axes, perm)

    def per_stage(w_S, x_SbTD, side_S):
        with rules_replaced(inner):
            return jax.vmap(layers_fn, spmd_axis_name=schedule.axes)(x_SbTD, w_S, side_S)

    def stats_shape():
        w0 = jax.tree.map(lambda a: a[:, 0], w)
        side0 = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], (S, *a.shape[1:])), side_M)
        return jax.eval_shape(per_stage, w0, state_SbTD, side0)[1]

    stats_acc = jax.tree.map(lambda s: jnp.zeros((S, R, *s.shape[1:]), s.dtype), stats_shape())

    def iteration(carry, t):
        state_SbTD, buf_SMbTD, stats_acc = carry
        q_S = t - stage_S  # microbatch visits this stage has begun before this one
        valid_S = (q_S >= 0) & (q_S < M * R)
        m_S, r_S = jnp.mod(q_S, M), jnp.clip(q_S // M, 0, R - 1)
        # Stage 0 takes its microbatch from the buffer (the input, or the previous repeat's output);
        # the others take what the previous stage passed on.
        first_SbTD = jax.lax.dynamic_index_in_dim(buf_SMbTD, jnp.mod(t, M), axis=1, keepdims=False)
        in_SbTD = jnp.where((stage_S == 0)[:, None, None, None], first_SbTD, state_SbTD)
        w_S = (
            jax.tree.map(lambda a: a[:, 0], w)
            if R == 1
            else jax.vmap(lambda ws, r: jax.tree.map(lambda a: a[r], ws))(w, r_S)
        )
        side_S = jax.tree.map(lambda a: a[m_S], side_M)
        out_SbTD, stats_S = per_stage(w_S, in_SbTD, side_S)
        # Every stage passes its output on (the last stage's arrives at stage 0).
        with jax.named_scope(scheduled.FORWARD_SCOPE):  # autodiff's transpose is the backward's
            state_SbTD = rotate(out_SbTD)
        last = t - (S - 1)
        m_last = jnp.mod(last, M)
        keep = (stage_S == 0) & (last >= 0) & (last < M * R)
        slot_SbTD = jax.lax.dynamic_index_in_dim(buf_SMbTD, m_last, axis=1, keepdims=False)
        slot_SbTD = jnp.where(keep[:, None, None, None], state_SbTD, slot_SbTD)
        buf_SMbTD = jax.lax.dynamic_update_index_in_dim(buf_SMbTD, slot_SbTD, m_last, axis=1)
        stats_acc = jax.tree.map(
            lambda acc, s: jax.vmap(lambda a, x, r, v: a.at[r].add(jnp.where(v, x, jnp.zeros_like(x))))(
                acc, s, r_S, valid_S
            ),
            stats_acc,
            stats_S,
        )
        return (state_SbTD, buf_SMbTD, stats_acc), None

    (_, buf_SMbTD, stats_acc), _ = jax.lax.scan(
        iteration, (state_SbTD, buf_SMbTD, stats_acc), jnp.arange(schedule.forward_iterations)
    )
    out_BTD = buf_SMbTD[0].swapaxes(0, 1).reshape(B, T, D)
    out_BTD = constrain(out_BTD, rules.spec(x_axes))  # each stage keeps its rows of the output

    def canonical(acc):  # (S, R, Gps, ...) -> (G, ...) in canonical order: group (r*S + s)*Gps + j
        return acc.swapaxes(0, 1).reshape(G, *acc.shape[3:])

    stats = jax.tree.map(canonical, stats_acc)
    if combine_stats is not None and stats is not None:
        stats = combine_stats(stats, M)
    return out_BTD, stats


def loss(layers_fn, embed, inputs, xs, side, *, x_axes, head, tail, xs_axes=None, combine_stats=None,
         schedule: Schedule):  # fmt: skip
    """(tail's (loss, sums), stats) of the embedding, the layer stack, the head and the loss
    (`tail`, a spmd.core.family.Tail), all per microbatch in the scheduled forward and backward of
    spmd/parallel/scheduled.py (1F1B, ZB-H1 and their interleaved forms). `inputs`: the embedding's per-row inputs
    (leading axis B); `head(x_BTD) -> logits`; the rest as `run`'s."""
    rules, mesh = active()
    G = jax.tree.leaves(xs)[0].shape[0]

    def constrain(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    inner = layer_rules(rules, schedule)
    w = stage_weights(xs, xs_axes, schedule, rules, constrain)

    def canonical(acc):  # (S, R, Gps, ...) -> (G, ...) in canonical order: group (r*S + s)*Gps + j
        return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(G, *a.shape[3:]), acc)

    loss, sums, stats = scheduled.loss(
        layers_fn, embed, inputs, w, side, head=head, tail=tail.fn, rows=tail.rows,
        ticks=schedule.ticks, aux_loss=tail.aux_loss,
        combine_stats=combine_stats or (lambda s, n: s), canonical=canonical, axes=schedule.axes,
        res_spec=inner.spec(x_axes), inner=inner, mesh=mesh,
    )  # fmt: skip
    return (loss, sums), stats


def provider(schedule: Schedule):
    """The parallel implementation the model asks for as "pipeline" (spmd.core.logical.provided)."""
    return functools.partial(run, schedule=schedule)


def loss_provider(schedule: Schedule):
    """... and as "pipeline_loss" (schedules that schedule their backward): the embedding, layers,
    head and loss together."""
    return functools.partial(loss, schedule=schedule)


# --- the strategy ---------------------------------------------------------------------------------


def minimum(step) -> float:
    """Every row of the device's batch enters each of its stage's R layer groups once: its
    activations sent on once per repeat, forward, and their gradient back."""
    schedule = step.plan.schedule
    if schedule is None:
        return 0.0
    return 2 * schedule.repeats * step.B * step.T * step.fig.d_model * step.itemsize


def stage_traffic(c, seen):
    """Activations between stages (ppermute) and the stages' rows to and from stage 0."""
    schedule = seen.schedule
    if schedule is None or not set(seen.axes) <= set(schedule.axes):
        return None
    if c.kind == "collective-permute" and "ppermute" in c.op_name:
        return rule(["layers"], seen.axes), "pipeline: each microbatch's activations to the next stage"
    cfg, sizes = seen.cfg, seen.sizes
    rows = cfg.train.global_batch_size // cfg.train.microbatches  # a stage's rows, inside
    rows //= axes_size(sizes, [a for a in seen.rules.mapping.get("batch", ()) if a not in schedule.axes])
    T, D = cfg.train.seq_len, cfg.model.d_model
    M, S = schedule.microbatches, schedule.stages
    buffers = {
        squeeze((M, rows // M, T, D)),
        squeeze((rows, T, D)),
        squeeze((rows // S, T, D)),  # the rows one stage computes the head of
        # a scheduled pipeline: one microbatch's rows, and one stage's share of them, each tick
        squeeze((rows // M, T, D)),
        squeeze((rows // M // S, T, D)),
    }
    if any(squeeze(shape) in buffers for shape in seen.shapes):
        return rule(["layers"], seen.axes), (
            "pipeline: the stages' input rows to stage 0 and the outputs from it to the stages "
            "that compute their head and loss (forward), their gradients back (backward); under "
            "a scheduled pipeline one microbatch's each tick"
        )
    return None


STRATEGY = Strategy(
    name="stage",
    rank=60,
    axes=(STAGE_AXIS,),
    minimum=minimum,
    attributions=(Attribution(210, "collective", stage_traffic),),
)
