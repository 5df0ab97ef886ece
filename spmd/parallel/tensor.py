"""Tensor parallelism (Megatron): heads and MLP units split over `tensor` (the rules' `heads`,
`kv_heads`, `mlp`), so a layer's matmuls produce partial sums that are all-reduced; with `act_seq`
over `tensor` too (Megatron sequence parallelism) the residual stream is split along the
sequence between them. A vocabulary split over an axis that does not carry the batch is
Megatron's vocab-parallel embedding and logits (its sums: spmd.parallel.strategy.Step.vocab_sums,
counted under the axis's own strategy).

Its share of the analytic minimum: the (B, T, D) activations all-reduced twice per layer forward
(attention and MLP outputs) and twice backward, in the compute dtype. (XLA:CPU sends bf16 tensors
as fp32, so its bf16 figures run up to 2x over this; the TPU compiler sends them as they are.)
Under full remat the backward recomputes the forward as far as the residual after attention,
which the MLP's backward reads: one more (the MLP output's is dead there). Under save_dots the
projections' outputs are saved as the program sees them, i.e. already summed. An MoE layer's MLP
is its experts: their partial sums are of the dispatched tokens (B, E, C, D), which the backward
also recomputes under any remat (the expert einsums have a batch dimension, so save_dots does not
keep them, and combining reads their output).
"""

import math

from spmd.parallel.strategy import (
    CONTRACTED_IN_LAYERS,
    CONTRACTED_OUTSIDE,
    Attribution,
    Strategy,
    names_on,
    rule,
)

AXIS = "tensor"


def minimum(step) -> float:
    t = step.sizes.get(AXIS, 1)
    rules = step.plan.rules
    if t <= 1 or AXIS not in rules.mapping.get("heads", ()) + rules.mapping.get("mlp", ()):
        return 0.0
    m, fig, act, n_layers = step.model, step.fig, step.act, step.n_layers
    attention = 2 + (1 if m.remat == "full" else 0)
    n_moe = fig.moe_layers * n_layers // fig.n_layers
    moe = 2 + (1 if m.remat != "none" else 0)
    sums = n_layers * attention * act + (n_layers - n_moe) * 2 * act + n_moe * moe * step.dispatched
    return 2 * sums * (t - 1) / t


def expert_sums(c, seen, shape):
    """Partial sums of the experts' matmuls: an all-reduce of the dispatched tokens."""
    if seen.dispatched and c.kind == "all-reduce" and math.prod(shape) == seen.dispatched:
        names = names_on(seen.rules, seen.axes, CONTRACTED_IN_LAYERS)
        if names:
            return rule(names, seen.axes), "partial sums of the experts' matmuls (dispatched tokens)"
    return None


def partial_sums(c, seen, shape):
    """An activation summed over an axis that splits a contraction: a layer's matmuls (heads,
    MLP units, inside the layer scan) or the logits' (the vocabulary, outside it)."""
    if c.kind != "all-reduce" or not seen.holds_tokens(shape):
        return None
    names = names_on(seen.rules, seen.axes, CONTRACTED_IN_LAYERS if seen.in_layers else CONTRACTED_OUTSIDE)
    if names:
        where = "a layer's matmuls" if seen.in_layers else "the logits' matmul"
        return rule(names, seen.axes), f"partial sums of {where} over a split dimension"
    return None


def heads(c, seen, shape):
    """Attention operands moved between the split heads (inside the layer scan)."""
    if not seen.holds_tokens(shape):
        return None
    names = names_on(seen.rules, seen.axes, ("heads", "kv_heads") if seen.in_layers else ())
    return (rule(names, seen.axes), "attention operands regrouped across the split heads") if names else None


STRATEGY = Strategy(
    name="tensor",
    rank=30,
    axes=(AXIS,),
    minimum=minimum,
    attributions=(
        Attribution(310, "activation", expert_sums),
        Attribution(340, "activation", partial_sums),
        Attribution(350, "activation", heads),
    ),
)
