"""`spmd-dryrun --explain`: each collective of a compiled step attributed to the logical-axis rule
(and the parameter or activation) that caused it.

A collective runs over some mesh axes; the rules say which logical names map to them. Which of
those names is the cause is read from what is moved, matched against what the plan knows:

- an array shaped like a parameter's shard (or one layer of it, inside the layer scan), gathered
  along the dimension a rule splits: that parameter's weights, "embed -> fsdp" (also where the TPU
  compiler gathers by all-reducing shards written into zeros);
- a parameter-shaped array reduced over axes that split the batch (or the sequence): its
  gradient, "batch -> data";
- an array with the per-device tokens (B, T, ...) or flattened (B x T, ...): an activation. Summed
  over an axis that splits a contraction: partial sums of a matmul over heads/mlp (inside the layer
  scan) or the vocabulary (outside it: embedding lookup, logits), "mlp -> tensor"; regrouped or
  moved: attention operands ("heads -> tensor"), keys and values ("seq -> context"), dispatched
  tokens ("expert -> expert");
- scalars and per-token statistics: loss sums, token counts, norms, softmax statistics.

What matches nothing is listed as unexplained, never guessed.
"""

import collections
import math
import re

from spmd.core.mesh import axes_size, spec_axes

# Logical names whose split makes a contraction's output a partial sum, by where they act (the
# embedding dimension is contracted in every projection into heads or MLP units, and by RMSNorm).
CONTRACTED_IN_LAYERS = ("heads", "kv_heads", "mlp", "head_dim", "expert_mlp", "embed")
CONTRACTED_OUTSIDE = ("vocab", "act_vocab", "embed")
TOKEN_NAMES = ("batch", "seq", "act_seq")
# A gather or a reduce-scatter the compiler ran as an all-reduce (the TPU compiler does so for a
# group spanning a whole slice): it does the job of the one-way collective and sends twice its
# bytes, so half of what these send is the compiler's choice of algorithm, not the sharding's.
AS_ALL_REDUCE_GATHER = "weights gathered (as an all-reduce of zero-padded shards)"
AS_ALL_REDUCE_SCATTER = (
    "gradients reduced (as an all-reduce of the whole gradient; each device keeps its shard)"
)
AS_ALL_REDUCE_UPDATE = "updated parameters gathered (sharded update; as an all-reduce of zero-padded shards)"
AS_ALL_REDUCE = (AS_ALL_REDUCE_GATHER, AS_ALL_REDUCE_SCATTER, AS_ALL_REDUCE_UPDATE)


def _names_on(rules, axes, names) -> list[str]:
    """Which of `names` the rules map onto any of `axes`."""
    return [n for n in names if set(rules.mapping.get(n, ())) & set(axes)]


def _param_shapes(plan, axes) -> list[tuple]:
    """(shape, param, dim gathered or None, layer-sliced) for each shape a parameter can take in a
    collective over `axes`: its shard, and its shard gathered along a dimension split over `axes`;
    each also without the leading `layers` dimension (one layer, inside the scan)."""
    sizes = dict(plan.mesh.shape)
    # Under a sharded weight update the gradient is reduce-scattered into the optimizer's shards.
    z = axes_size(sizes, [a for a in plan.rules.shard_optimizer_over if a in axes])
    out = []
    for p in plan.params:
        variants = [(tuple(p.local_shape), None)]
        for d, entry in enumerate(p.spec):
            on = [a for a in spec_axes(entry) if a in axes]
            if on:
                gathered = list(p.local_shape)
                gathered[d] *= axes_size(sizes, on)
                variants.append((tuple(gathered), d))
        if z > 1:
            for d, n in enumerate(p.local_shape):
                if n % z == 0:
                    variants.append(
                        (tuple(p.local_shape[:d]) + (n // z,) + tuple(p.local_shape[d + 1 :]), None)
                    )
        for shape, d in variants:
            stacked = bool(p.logical) and p.logical[0] == "layers" and len(shape) > 1
            lead, body = (shape[:1], shape[1:]) if stacked else ((), shape)
            shapes = [shape] + ([body] if stacked else [])  # the stack, and one layer inside the scan
            # Projections run flattened to 2-D (the models' `project`); the layers dim stays apart.
            for k in range(1, len(body)):
                flat = (math.prod(body[:k]), math.prod(body[k:]))
                shapes += [lead + flat] + ([flat] if stacked else [])
            out += [(sh, p, d) for sh in dict.fromkeys(shapes)]
    return out


def _squeeze(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _rule(names, axes) -> str:
    return f"{'/'.join(names)} -> {','.join(axes)}"


def attribute(c, plan, cfg) -> tuple[str, str] | None:
    """(rule, what) for one hlo.Collective, or None where nothing explains it."""
    rules, axes = plan.rules, c.axes
    if not axes:
        return None
    in_layers = "/while/body/" in c.op_name
    token_names = _names_on(rules, axes, TOKEN_NAMES)
    shapes = c.shapes or ((),)

    # Weights and gradients: arrays shaped like a parameter's shard.
    params = _param_shapes(plan, axes)
    zero_axes = [a for a in axes if a in rules.shard_optimizer_over]
    for shape in shapes:
        for p_shape, p, dim in params:
            if _squeeze(shape) != _squeeze(p_shape):  # (compilers add and drop unit dims)
                continue
            if c.kind == "all-gather" and dim is not None:
                return _rule([p.logical[dim]], axes), "weights gathered"
            split = [d for d, e in enumerate(p.spec) if set(spec_axes(e)) & set(axes)]
            if c.kind == "collective-permute" and "windowed_dot_general_body_" in c.computation:
                # The SPMD partitioner's windowed einsum: blocks passed around a ring, one step per
                # loop iteration, each overlapped with a block of the matmul.
                if "_body_ag" in c.computation and split:
                    return _rule(
                        [p.logical[split[0]]], axes
                    ), "weights gathered (a ring of collective-permutes in the matmul's loop)"
                if "_body_rs" in c.computation and token_names:
                    return _rule(
                        token_names, axes
                    ), "gradients reduced (a ring of collective-permutes in the matmul's loop)"
            forward = "transpose(" not in c.op_name  # gradients come from the backward pass
            if dim is not None and (c.as_gather or (c.kind == "all-reduce" and forward and c.op_name)):
                return _rule([p.logical[dim]], axes), AS_ALL_REDUCE_GATHER
            if zero_axes and (c.kind == "all-gather" or c.as_gather):
                return (
                    f"shard_optimizer_over -> {','.join(axes)}",
                    AS_ALL_REDUCE_UPDATE if c.as_gather else "updated parameters gathered (sharded update)",
                )
            if c.kind == "collective-permute" and split and "dot_general" in c.op_name:
                return _rule([p.logical[split[0]]], axes), (
                    "weight or gradient blocks passed around a ring (a windowed matmul's first or last step)"
                )
            if c.kind == "all-reduce" and (dim is not None or zero_axes) and token_names:
                # The whole gradient summed everywhere, each device then keeping its shard (of the
                # parameter, or of the optimizer state under a sharded update).
                return _rule(token_names, axes), AS_ALL_REDUCE_SCATTER
            if c.kind in ("all-reduce", "reduce-scatter") and token_names:
                return _rule(token_names, axes), "gradients reduced"

    schedule = getattr(plan, "schedule", None)
    if schedule is not None and set(axes) <= set(schedule.axes):
        if c.kind == "collective-permute" and "ppermute" in c.op_name:
            return _rule(["layers"], axes), "pipeline: each microbatch's activations to the next stage"
        sizes = dict(plan.mesh.shape)
        rows = cfg.train.global_batch_size // cfg.train.microbatches  # a stage's rows, inside
        rows //= axes_size(sizes, [a for a in rules.mapping.get("batch", ()) if a not in schedule.axes])
        T, D = cfg.train.seq_len, cfg.model.d_model
        buffers = {
            _squeeze((schedule.microbatches, rows // schedule.microbatches, T, D)),
            _squeeze((rows, T, D)),
            _squeeze((rows // schedule.stages, T, D)),  # the rows one stage computes the head of
        }
        if any(_squeeze(shape) in buffers for shape in shapes):
            return _rule(["layers"], axes), (
                "pipeline: the stages' input rows to stage 0 and the outputs from it to the stages "
                "that compute their head and loss (forward), their gradients back (backward)"
            )
    if "ppermute" in c.op_name and "shard_map" in c.op_name and _names_on(rules, axes, ("seq",)):
        return _rule(_names_on(rules, axes, ("seq",)), axes), "keys and values passed around the ring"
    if "_take" in c.op_name:  # the embedding lookup (jnp.take on the vocab-by-embed table)
        embed = next((p for p in plan.params if p.logical and p.logical[0] == "vocab"), None)
        names = _names_on(rules, axes, embed.logical if embed else ()) or token_names
        if names:
            return _rule(names, axes), "embedding lookup: token ids and rows moved"
        if embed is not None:
            return (
                f"{'/'.join(embed.logical)} (moved over {','.join(axes)})",
                "embedding lookup split by the partitioner over devices that hold the table whole",
            )

    source = c.op_name.replace("\\", "")  # HLO metadata escapes the quotes
    if source.startswith("state['params']"):
        # A parameter read straight from the step's inputs and moved over axes its rules do not
        # split it along: the partitioner splitting the work of a replicated parameter (the
        # embedding lookup, the output head) across those devices.
        path = "/".join(re.findall(r"\['([^']+)'\]", source)[1:])
        p = next((p for p in plan.params if p.path == path), None)
        if p is not None:
            return (
                f"{'/'.join(n for n in p.logical if n)} (moved over {','.join(axes)})",
                "weights moved: the partitioner splits the parameter's work over devices that hold it whole",
            )
    sizes = dict(plan.mesh.shape)
    batch_split = axes_size(sizes, [a for a in rules.mapping.get("batch", ()) if a in sizes])
    B = max(1, cfg.train.global_batch_size // cfg.train.microbatches // batch_split)
    T, D = cfg.train.seq_len, cfg.model.d_model
    seq_split = axes_size(sizes, [a for a in rules.mapping.get("seq", ()) if a in sizes])
    token_counts = {B * T, B * (T // seq_split), B * (T // max(1, axes_size(sizes, axes)))}
    if schedule is not None and in_layers:
        # Inside the pipeline: one microbatch's rows, under the stage axis the vmap adds (size 1).
        B = max(1, B // schedule.microbatches)
        token_counts = {n // schedule.microbatches for n in token_counts} | token_counts
        shapes = tuple(s[1:] if len(s) > 1 and s[0] == 1 else s for s in shapes)
    # Elements of the (B, E, C, D) tokens dispatched to the experts, per device (0: a dense model).
    figures = plan.family.figures(cfg.model, cfg.train.seq_len)
    dispatched = math.prod(figures.dispatched_shape(B)) if figures.n_experts else 0
    for shape in shapes:
        if dispatched and c.kind == "all-reduce" and math.prod(shape) == dispatched:
            names = _names_on(rules, axes, CONTRACTED_IN_LAYERS)
            if names:
                return _rule(names, axes), "partial sums of the experts' matmuls (dispatched tokens)"
        if math.prod(shape) <= 1 or (math.prod(shape) in token_counts and shape[-1] != D):
            # Scalars (loss, token counts, norms) and per-token statistics (softmax max/sum).
            names = (
                token_names
                or _names_on(rules, axes, CONTRACTED_OUTSIDE)
                or _names_on(rules, axes, CONTRACTED_IN_LAYERS)
            )
            if names:
                return _rule(names, axes), "scalars and per-token statistics (loss, counts, norms, softmax)"
        # Activations: the leading dims hold the device's tokens.
        if not shape:
            continue
        tokens = shape[0] in token_counts or (len(shape) > 1 and shape[0] * shape[1] in token_counts)
        if not tokens and not (len(shape) > 1 and shape[0] == B):
            continue
        if c.kind == "all-to-all" and _names_on(rules, axes, ("expert",)):
            return _rule(_names_on(rules, axes, ("expert",)), axes), "dispatched tokens (MoE)"
        if c.kind == "all-reduce":
            names = _names_on(rules, axes, CONTRACTED_IN_LAYERS if in_layers else CONTRACTED_OUTSIDE)
            if names:
                where = "a layer's matmuls" if in_layers else "the logits' matmul"
                return _rule(names, axes), f"partial sums of {where} over a split dimension"
        names = _names_on(rules, axes, ("heads", "kv_heads") if in_layers else ())
        if names:
            return _rule(names, axes), "attention operands regrouped across the split heads"
        names = _names_on(rules, axes, ("act_seq", "act_embed", "act_vocab"))
        if names:
            return _rule(names, axes), "activations resharded"
    # Last: a layer's weight gathered in a transposed layout (the TPU compiler's choice for
    # llama-70b fsdp=256: wk and wv as (K, H, D)), its dims a permutation of the gathered shard's;
    # by an all-gather, or an all-reduce of zero-padded shards in the forward or its
    # recomputation (a gradient, summed in the backward, is not a gather). Only over the axes that
    # split the weight, outside a pipeline's stage axes.
    gather = c.kind == "all-gather" or (
        c.kind == "all-reduce"
        and (c.as_gather or "transpose(" not in c.op_name or "rematted_computation" in c.op_name)
    )
    if gather and in_layers and not (schedule is not None and set(axes) & set(schedule.axes)):
        for shape in shapes:
            for p_shape, p, dim in params:
                if dim is not None and sorted(_squeeze(shape)) == sorted(_squeeze(p_shape)):
                    what = (
                        AS_ALL_REDUCE_GATHER
                        if c.kind == "all-reduce"
                        else "weights gathered (in a transposed layout)"
                    )
                    return _rule([p.logical[dim]], axes), what
    return None


def explain(setup, items, volumes) -> dict:
    """{"rules": [{rule, what, kind, count, volume_bytes}], "unexplained": [...]} for dry_run's
    collectives `items` (hlo.Collective) and the bytes each sends per step (`volumes`)."""
    by = collections.defaultdict(lambda: {"count": 0, "volume_bytes": 0.0})
    unexplained = []
    for c, volume in zip(items, volumes):
        if not c.axes:  # groups of one device: nothing is sent
            continue
        found = attribute(c, setup.plan, setup.cfg)
        if found is None:
            unexplained.append(
                {"kind": c.kind, "axes": list(c.axes), "shapes": [list(s) for s in c.shapes],
                 "count": c.count, "volume_bytes": volume, "op_name": c.op_name}
            )  # fmt: skip
            continue
        row = by[(found[0], found[1], c.kind)]
        row["count"] += c.count
        row["volume_bytes"] += volume
    rows = [{"rule": r, "what": w, "kind": k, **v} for (r, w, k), v in by.items()]
    rows.sort(key=lambda r: -r["volume_bytes"])
    # What the gathers and reduce-scatters run as all-reduces send beyond the one-way collective.
    excess = sum(r["volume_bytes"] / 2 for r in rows if r["what"] in AS_ALL_REDUCE)
    return {"rules": rows, "unexplained": unexplained, "as_all_reduce_excess_bytes": excess}
