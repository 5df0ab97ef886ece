"""Token cross-entropy over a large vocabulary without a float32 copy of the logits.

Autodiff of `optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), targets)`
keeps float32 logits (or their softmax) of the whole batch for the backward: B x T x V x 4 bytes,
8 GiB for 16k tokens of a 128k vocabulary, beside the 16-bit logits themselves, and passes over
them several times. Here each row's logsumexp and target logit are computed in float32 as the
16-bit logits are read; the backward keeps only those logits and the (B, T) logsumexp, and writes
the gradient softmax - onehot (plus the z-loss's share through the logsumexp) in one elementwise
pass in the logits' dtype.

Legend: B batch, T sequence, V vocab.
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def cross_entropy(logits_BTV, targets_BT):
    """(cross-entropy, logsumexp), each (B, T) float32: lse - logit[target], and lse (for z-loss).
    Targets outside [0, V) (a masked position's id) count as 0: the caller masks them."""
    return _forward(logits_BTV, targets_BT)[0]


def target_logits(logits_BTV, targets_BT):
    """logits[..., target] of each position, as a masked sum over the vocabulary rather than a
    gather: XLA's partitioner aborts on a gather from vocabulary-split logits inside a region
    manual over some mesh axes (a pipeline whose stages diverge), and the sum adds only zeros to
    the one logit, so it is exact. Targets outside [0, V) give 0."""
    hit_BTV = (
        jax.lax.broadcasted_iota(targets_BT.dtype, logits_BTV.shape, logits_BTV.ndim - 1)
        == targets_BT[..., None]
    )
    return jnp.sum(jnp.where(hit_BTV, logits_BTV, jnp.zeros((), logits_BTV.dtype)), axis=-1)


def _forward(logits_BTV, targets_BT):
    lse_BT = jax.nn.logsumexp(logits_BTV.astype(jnp.float32), axis=-1)
    safe_BT = jnp.clip(targets_BT, 0, logits_BTV.shape[-1] - 1)
    target_BT = target_logits(logits_BTV, safe_BT).astype(jnp.float32)
    return (lse_BT - target_BT, lse_BT), (logits_BTV, safe_BT, lse_BT)


def _backward(res, cotangents):
    logits_BTV, safe_BT, lse_BT = res
    g_ce_BT, g_lse_BT = cotangents
    # d ce / d logits = softmax - onehot(target); d lse / d logits = softmax.
    p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
    onehot_BTV = (
        jax.lax.broadcasted_iota(safe_BT.dtype, logits_BTV.shape, logits_BTV.ndim - 1) == safe_BT[..., None]
    )
    d_BTV = (g_ce_BT + g_lse_BT)[..., None] * p_BTV - jnp.where(onehot_BTV, g_ce_BT[..., None], 0.0)
    return d_BTV.astype(logits_BTV.dtype), None


cross_entropy.defvjp(_forward, _backward)
