"""The decoder against plain references: causality, GQA, remat, parameter and FLOP counts."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd.models.attention import xla_attention
from spmd.models.llama import Llama, LlamaConfig, count_params, flops_per_token
from spmd.parallel.sharding import init_params

CFG = LlamaConfig(dtype="float32")


def apply(cfg, params, tokens):
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: _build(cfg)), nnx.Param)
    return nnx.merge(graphdef, params)(tokens)


def _build(cfg):
    with nnx.use_eager_sharding(False):
        return Llama(cfg, rngs=nnx.Rngs(0))


def reference_attention(q, k, v):
    """Multi-head attention with K/V repeated per query head, causal."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    T = q.shape[1]
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(np.tril(np.ones((T, T), bool))[None, None], s, -np.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_gqa_attention_matches_repeated_kv(n_kv):
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 16, n_kv, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 16, n_kv, 8)), jnp.float32)
    np.testing.assert_allclose(xla_attention(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_causal_and_parameter_count():
    params = jax.jit(lambda: init_params(Llama, CFG, 0))()
    assert sum(x.size for x in jax.tree.leaves(params)) == count_params(CFG)
    tokens = np.random.default_rng().integers(0, 256, size=(2, 32))
    changed = tokens.copy()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    a, b = apply(CFG, params, tokens), apply(CFG, params, changed)
    np.testing.assert_allclose(a[:, :20], b[:, :20], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 20:], b[:, 20:])


def test_tied_embeddings_share_the_table():
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    params = jax.jit(lambda: init_params(Llama, cfg, 0))()
    assert "head_DV" not in params
    assert sum(x.size for x in jax.tree.leaves(params)) == count_params(cfg)


def test_tied_and_untied_models_start_at_the_uniform_loss():
    """ln V at initialisation: the tied table used to start at std 1 and give a loss of ~64."""
    tokens = np.random.default_rng(0).integers(0, 256, (4, 64))
    targets = np.roll(tokens, -1, axis=1)
    for tied in (False, True):
        cfg = dataclasses.replace(CFG, tie_embeddings=tied)
        params = jax.jit(lambda cfg=cfg: init_params(Llama, cfg, 0))()
        logits = apply(cfg, params, tokens)
        loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))
        assert abs(float(loss) - math.log(256)) < 0.05, (tied, float(loss))


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_changes_nothing_numerically(remat):
    params = jax.jit(lambda: init_params(Llama, CFG, 0))()
    tokens = np.random.default_rng().integers(0, 256, size=(2, 16))

    def loss(cfg):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(apply(cfg, p, tokens) ** 2)))(params)

    (l0, g0), (l1, g1) = loss(CFG), loss(dataclasses.replace(CFG, remat=remat))
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_bf16_compute_keeps_fp32_params_and_close_logits():
    params = jax.jit(lambda: init_params(Llama, CFG, 0))()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens = np.random.default_rng().integers(0, 256, size=(2, 16))
    lo = apply(dataclasses.replace(CFG, dtype="bfloat16"), params, tokens)
    assert lo.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lo, np.float32), apply(CFG, params, tokens), atol=5e-2)


def test_flops_per_token_formula():
    cfg = CFG
    D, L, V, F = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.d_ff
    matmul = L * (2 * D * 4 * 16 + 2 * D * 2 * 16 + 3 * D * F + 2 * D) + D + D * V
    assert flops_per_token(cfg, 64) == 6 * matmul + 6 * L * 64 * 4 * 16


def test_scan_unroll_changes_nothing_numerically():
    params = jax.jit(lambda: init_params(Llama, CFG, 0))()
    tokens = np.random.default_rng().integers(0, 256, size=(2, 16))
    np.testing.assert_allclose(
        apply(CFG, params, tokens),
        apply(dataclasses.replace(CFG, scan_unroll=2), params, tokens),
        rtol=1e-5,
        atol=1e-6,
    )


def test_swiglu_low_precision_backward_is_the_fp32_derivative_rounded_once():
    """spmd.models.layers.swiglu in bf16 (its own backward, fp32 inside): output and gradients equal
    the fp32 computation on the same bf16 inputs to one bf16 rounding, closer than autodiff of
    the plain bf16 form; in fp32 it is the plain form, bit for bit."""
    from spmd.models.layers import swiglu

    rng = np.random.default_rng()
    gate, up = (jnp.asarray(rng.normal(size=(64, 96)) * s, jnp.float32) for s in (3.0, 1.0))
    w = jnp.asarray(rng.normal(size=(64, 96)), jnp.float32)

    def plain(a, b):
        return jax.nn.silu(a) * b

    def grads(f, a, b):
        return jax.grad(lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * w), (0, 1))(a, b)

    np.testing.assert_array_equal(swiglu(gate, up), plain(gate, up))
    for g1, g2 in zip(grads(swiglu, gate, up), grads(plain, gate, up)):
        np.testing.assert_array_equal(g1, g2)
    g16, u16 = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
    exact = plain(g16.astype(jnp.float32), u16.astype(jnp.float32))
    np.testing.assert_array_equal(swiglu(g16, u16), exact.astype(jnp.bfloat16))
    truth = grads(plain, g16.astype(jnp.float32), u16.astype(jnp.float32))

    def err(x, ref):
        return float(jnp.linalg.norm(x.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))

    for name, ours, theirs, ref in zip(
        ("gate", "up"), grads(swiglu, g16, u16), grads(plain, g16, u16), truth
    ):
        assert ours.dtype == jnp.bfloat16
        assert err(ours, ref) <= 2**-8 and err(ours, ref) < err(theirs, ref), (
            name,
            err(ours, ref),
            err(theirs, ref),
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_backward_is_the_rotation_back(dtype):
    """spmd.models.layers.rope (its own backward: the rotation by the negated angle): output bit for bit
    the plain formula's, gradient equal to autodiff's of it (fp32 to rounding; bf16 to one bf16
    rounding)."""
    from spmd.assembly.config import load_config
    from spmd.models.layers import rope, rope_frequencies

    rng = np.random.default_rng()
    cfg = load_config("tiny").model
    x = jnp.asarray(rng.normal(size=(2, 24, 4, cfg.head_dim)), dtype)
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 1000, size=(2, 24)))
    freq = rope_frequencies(cfg)

    def plain(x, positions, freq_h):
        angle = positions[..., None].astype(jnp.float32) * freq_h[None, None, :]
        cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    def grad(f):
        return jax.jit(jax.grad(lambda x: jnp.sum(f(x, pos, freq).astype(jnp.float32) * w)))(x)

    np.testing.assert_array_equal(jax.jit(rope)(x, pos, freq), jax.jit(plain)(x, pos, freq))
    ours, theirs = grad(rope), grad(plain)
    assert ours.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 2**-8
    np.testing.assert_allclose(
        np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("n_in", [1, 2])
def test_float32_weight_grads_leave_the_matmul_in_float32(n_in):
    """train.grad_reduce_dtype = float32: a bf16 projection's weight gradient is accumulated in
    fp32 (what a bf16 dot of the same operands rounds to bf16), so it equals the fp32 contraction
    of the bf16 operands; the input's gradient is the plain one, in bf16."""
    from spmd.core.logical import Lowering, lowered
    from spmd.models.layers import project

    rng = np.random.default_rng()
    K = (4, 16)[2 - n_in :]  # the contracted axes
    x = jnp.asarray(rng.normal(size=(2, 8, *K)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(*K, 24)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(*x.shape[: x.ndim - n_in], 24)), jnp.bfloat16)

    def vjp(f32):
        with lowered(Lowering(float32_weight_grads=f32)):
            y, pull = jax.vjp(lambda x, w: project(x, w, n_in), x, w)
        return y, *pull(g)

    y, dx, dw = vjp(True)
    y0, dx0, dw0 = vjp(False)
    lead = tuple(range(x.ndim - n_in))
    exact = jnp.tensordot(x.astype(jnp.float32), g.astype(jnp.float32), axes=(lead, lead))
    np.testing.assert_allclose(np.asarray(dw), np.asarray(exact), rtol=1e-5, atol=1e-5)
    assert dw.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx0, np.float32))
    assert (
        np.abs(np.asarray(dw0) - np.asarray(exact)).max() > np.abs(np.asarray(dw) - np.asarray(exact)).max()
    )
