"""Attention implementations, selected by `ModelConfig.attention_impl`.

Legend: B batch, T query positions, S key positions, N query heads, K kv heads,
G query heads per kv head (N = K * G), H head dim.
"""

import jax
import jax.numpy as jnp


def xla_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = True):
    """Plain softmax attention; GQA by grouping query heads, never repeating K/V."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    logits_BKGTS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32
    ) * (H**-0.5)
    if causal:
        S = k_BSKH.shape[1]
        mask_TS = jnp.arange(T)[:, None] >= jnp.arange(S)[None, :]
        logits_BKGTS = jnp.where(mask_TS[None, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
    return out_BTKGH.reshape(B, T, N, H)


# Pallas flash, chunked and ring attention register here as their issues land.
ATTENTION_IMPLS = {"xla": xla_attention}
