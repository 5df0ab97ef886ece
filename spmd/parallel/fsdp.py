"""Fully sharded data parallelism (ZeRO-3): parameters split over the axes that also split the
batch (`fsdp`), gathered for compute and their gradients reduce-scattered. The rules say which
dimension of each weight the axis splits (e.g. `embed = "fsdp"`); GSPMD inserts the gathers.

Its share of the analytic minimum: every weight gathered forward and again backward, its gradient
reduce-scattered, in the dtype the model uses it in (ParamInfo.compute_cast; on TPU a float32
matmul at default precision reads its operands as bfloat16, and they are gathered as such),
except an untied embedding table, where moving the looked-up rows is less. Each layer's gathered
weights are freed after its forward and gathered again for its backward (there, once for
recomputation and gradients both): keeping them would hold every layer's unsharded weights from
forward to backward, the memory FSDP exists to save. That is ZeRO-3 and FSDP's default (torch's
reshard_after_forward); the layers' scan reads the sharded weights in both loops, so the compiler
gathers twice with or without remat.
"""

from spmd.core.mesh import axes_size, spec_axes
from spmd.parallel.strategy import AS_ALL_REDUCE_GATHER, Attribution, Strategy, rule, squeeze

GATHERS = 2  # per step: forward, and again in the backward


def minimum(step) -> float:
    total = 0.0
    for p in step.plan.params:
        f, used, read, _ = step.weight(p)
        if f <= 1:
            continue
        gathered = step.gathered(p)
        # the weights gathered (forward, again in the backward), the gradient reduce-scattered
        cost = (GATHERS * read / used + step.grad_factor(p)) * gathered * (f - 1) / f
        if p.logical[:1] == ("vocab",) and not step.fig.tie_embeddings:
            # The embedding table is only read by the lookup: instead of gathering it, the devices
            # can send each other the pieces of the rows their tokens need, and the rows' gradients
            # back; whichever is less.
            split = [a for a in spec_axes(p.spec[0]) if a in step.batch_axes] if p.spec else []
            row = gathered / (p.local_shape[0] * axes_size(step.sizes, split))
            cost = min(cost, 2 * step.B * step.T * row * (f - 1) / f)
        total += cost
    return total


def weights(c, seen, shape, p, dim):
    """An array shaped like a parameter's shard, gathered along a dimension a rule splits."""
    axes = seen.axes
    if c.kind == "all-gather" and dim is not None:
        return rule([p.logical[dim]], axes), "weights gathered"
    split = [d for d, e in enumerate(p.spec) if set(spec_axes(e)) & set(axes)]
    if c.kind == "collective-permute" and "windowed_dot_general_body_" in c.computation:
        # The SPMD partitioner's windowed einsum: blocks passed around a ring, one step per loop
        # iteration, each overlapped with a block of the matmul.
        if "_body_ag" in c.computation and split:
            return rule(
                [p.logical[split[0]]], axes
            ), "weights gathered (a ring of collective-permutes in the matmul's loop)"
        if "_body_rs" in c.computation and seen.token_names:
            return rule(
                seen.token_names, axes
            ), "gradients reduced (a ring of collective-permutes in the matmul's loop)"
    forward = "transpose(" not in c.op_name  # gradients come from the backward pass
    if dim is not None and (c.as_gather or (c.kind == "all-reduce" and forward and c.op_name)):
        return rule([p.logical[dim]], axes), AS_ALL_REDUCE_GATHER
    if c.kind == "collective-permute" and split and "dot_general" in c.op_name:
        return rule([p.logical[split[0]]], axes), (
            "weight or gradient blocks passed around a ring (a windowed matmul's first or last step)"
        )
    return None


def transposed(c, seen, shape, p_shape, p, dim):
    """A layer's weight gathered in a transposed layout (the TPU compiler's choice for llama-70b
    fsdp=256: wk and wv as (K, H, D)), its dims a permutation of the gathered shard's; by an
    all-gather, or an all-reduce of zero-padded shards in the forward or its recomputation (a
    gradient, summed in the backward, is not a gather). Only over the axes that split the weight,
    outside a pipeline's stage axes; tried after everything else."""
    gather = c.kind == "all-gather" or (
        c.kind == "all-reduce"
        and (c.as_gather or "transpose(" not in c.op_name or "rematted_computation" in c.op_name)
    )
    schedule = seen.schedule
    if not gather or not seen.in_layers or (schedule is not None and set(seen.axes) & set(schedule.axes)):
        return None
    if dim is not None and sorted(squeeze(shape)) == sorted(squeeze(p_shape)):
        what = AS_ALL_REDUCE_GATHER if c.kind == "all-reduce" else "weights gathered (in a transposed layout)"
        return rule([p.logical[dim]], seen.axes), what
    return None


STRATEGY = Strategy(
    name="fsdp",
    rank=10,
    axes=("fsdp",),
    minimum=minimum,
    attributions=(Attribution(110, "param", weights), Attribution(410, "late", transposed)),
)
