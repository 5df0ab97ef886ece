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

from spmd.core.mesh import axes_size
from spmd.parallel.strategy import (  # noqa: F401 (AS_ALL_REDUCE_*: what the explanation's rows say)
    AS_ALL_REDUCE,
    AS_ALL_REDUCE_GATHER,
    AS_ALL_REDUCE_SCATTER,
    AS_ALL_REDUCE_UPDATE,
    CONTRACTED_IN_LAYERS,
    CONTRACTED_OUTSIDE,
    Attribution,
    Seen,
    attributions,
    names_on,
    rule,
    squeeze,
)


def embedding_lookup(c, seen):
    """The embedding lookup (jnp.take on the vocab-by-embed table): token ids and rows moved; or
    the looked-up rows going to (and their gradient coming from) the batch's devices by an
    all-to-all over the axes that split the table's embed dimension (models.layers.embed_rows)."""
    embed = next((p for p in seen.plan.params if p.logical and p.logical[0] == "vocab"), None)
    if c.kind == "all-to-all" and embed is not None and names_on(seen.rules, seen.axes, ("embed",)):
        seen.tokens()
        if sum(math.prod(s) for s in seen.shapes) in {n * seen.D for n in seen.token_counts}:
            return rule(
                ["embed"], seen.axes
            ), "embedding rows looked up where the table's columns live, moved to the batch's devices"
    if c.kind == "all-gather" and embed is not None and "batch[" in c.op_name.replace("\\", ""):
        if names_on(seen.rules, seen.axes, ("embed",)):
            return rule(
                ["embed"], seen.axes
            ), "token ids gathered for the lookup where the table's columns live"
    if "_take" not in c.op_name:
        return None
    names = names_on(seen.rules, seen.axes, embed.logical if embed else ()) or seen.token_names
    if names:
        return rule(names, seen.axes), "embedding lookup: token ids and rows moved"
    if embed is not None:
        return (
            f"{'/'.join(embed.logical)} (moved over {','.join(seen.axes)})",
            "embedding lookup split by the partitioner over devices that hold the table whole",
        )
    return None


def partitioned_parameter(c, seen):
    """A parameter read straight from the step's inputs and moved over axes its rules do not split
    it along: the partitioner splitting the work of a replicated parameter (the embedding lookup,
    the output head) across those devices."""
    source = c.op_name.replace("\\", "")  # HLO metadata escapes the quotes
    if not source.startswith("state['params']"):
        return None
    path = "/".join(re.findall(r"\['([^']+)'\]", source)[1:])
    p = next((p for p in seen.plan.params if p.path == path), None)
    if p is None:
        return None
    return (
        f"{'/'.join(n for n in p.logical if n)} (moved over {','.join(seen.axes)})",
        "weights moved: the partitioner splits the parameter's work over devices that hold it whole",
    )


def statistics(c, seen, shape):
    """Scalars (loss, token counts, norms) and per-token statistics (softmax max/sum)."""
    if math.prod(shape) <= 1 or (math.prod(shape) in seen.token_counts and shape[-1] != seen.D):
        names = (
            seen.token_names
            or names_on(seen.rules, seen.axes, CONTRACTED_OUTSIDE)
            or names_on(seen.rules, seen.axes, CONTRACTED_IN_LAYERS)
        )
        if names:
            return rule(names, seen.axes), "scalars and per-token statistics (loss, counts, norms, softmax)"
    return None


def resharded(c, seen, shape):
    """Activations moved to another layout."""
    names = names_on(seen.rules, seen.axes, ("act_seq", "act_embed", "act_vocab"))
    if names and seen.holds_tokens(shape):
        return rule(names, seen.axes), "activations resharded"
    return None


# What the partitioner does by itself, among the strategies' attributions (spmd.parallel.strategy).
PARTITIONER = (
    Attribution(230, "collective", embedding_lookup),
    Attribution(240, "collective", partitioned_parameter),
    Attribution(320, "activation", statistics),
    Attribution(360, "activation", resharded),
)


def same_array(shape, p_shape, seen) -> bool:
    """Whether a collective's array is shaped as a parameter's: equal but for unit dims (compilers
    add and drop them), or, gathered over the collective's devices, with its first dim split into
    (those devices, rows of each): the form the TPU compiler gathers a sharded weight update in."""
    a, b = squeeze(shape), squeeze(p_shape)
    if a == b:
        return True
    split = len(a) == len(b) + 1 and a[0] * a[1] == b[0] and a[2:] == b[1:]
    return split and seen.c.kind == "all-gather" and a[0] == axes_size(seen.sizes, seen.axes)


def attribute(c, plan, cfg) -> tuple[str, str] | None:
    """(rule, what) for one hlo.Collective, or None where nothing explains it: the first of the
    strategies' attributions (and the partitioner's) that matches, scope by scope."""
    if not c.axes:
        return None
    seen = Seen(c, plan, cfg)
    scopes = {
        scope: attributions(scope, PARTITIONER)
        for scope in ("first", "param", "collective", "activation", "late")
    }
    for a in scopes["first"]:  # a collective whose axes alone say what it is
        found = a.match(c, seen)
        if found:
            return found
    for shape in seen.shapes:
        for p_shape, p, dim in seen.params:
            if not same_array(shape, p_shape, seen):
                continue
            for a in scopes["param"]:
                found = a.match(c, seen, shape, p, dim)
                if found:
                    return found
    for a in scopes["collective"]:
        found = a.match(c, seen)
        if found:
            return found
    seen.tokens()
    for shape in seen.activation_shapes:
        for a in scopes["activation"]:
            found = a.match(c, seen, shape)
            if found:
                return found
    for shape in seen.activation_shapes:
        for p_shape, p, dim in seen.params:
            for a in scopes["late"]:
                found = a.match(c, seen, shape, p_shape, p, dim)
                if found:
                    return found
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
