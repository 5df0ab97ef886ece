"""spmd/parallel/split_backward.py: a pullback cut into the input's gradient now and the weights'
later gives the pullback's gradients exactly, runs each matmul of the backward once, and hands the
second pass only what the first computed for it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.parallel.split_backward import split

L, B, D, F = 3, 4, 8, 16  # layers, rows, width, hidden


def _stack(seed):
    k = jax.random.split(jax.random.key(seed), 5)
    w = {"up": jax.random.normal(k[0], (L, D, F)), "gate": jax.random.normal(k[4], (L, D, F)) / 2,
         "down": jax.random.normal(k[1], (L, F, D)) / 4, "scale": 1 + jax.random.normal(k[2], (D,)) / 8}  # fmt: skip
    return w, jax.random.normal(k[3], (B, D))


def _layers(x_BD, w, remat=False):
    """A residual gated-MLP stack scanned over layers; `scale` is shared by every layer (the scan's
    constant, whose gradient the backward scan carries). `remat`: each layer recomputed in the
    backward (a remat region inside the backward scan's body)."""

    def layer(h_BD, wl):
        up_DF, gate_DF, down_FD = wl
        hs_BD = h_BD * w["scale"][None, :]
        a_BF = hs_BD @ up_DF
        u_BF = jnp.tanh(a_BF) * (hs_BD @ gate_DF)
        return h_BD + u_BF @ down_FD, jnp.sum(a_BF**2)

    layers = (w["up"], w["gate"], w["down"])
    h_BD, stats_L = jax.lax.scan(jax.checkpoint(layer) if remat else layer, x_BD, layers)
    return h_BD, stats_L


def _cut(seed, remat=False):
    w, x = _stack(seed)
    (y, stats), pull = jax.vjp(lambda x, w: _layers(x, w, remat), x, w)
    res, treedef = jax.tree.flatten(pull)
    g, g_stats = jax.random.normal(jax.random.key(seed + 1), y.shape), jnp.ones_like(stats)

    def backward(res, g, g_stats):
        g_x, g_w = jax.tree.unflatten(treedef, res)((g, g_stats))
        return [g_x, *jax.tree.leaves(g_w)]

    closed = jax.make_jaxpr(backward)(res, g, g_stats)
    cut = split(closed, 1, [True] * len(res) + [False, False])
    return cut, backward, res, g, g_stats


def _dots(fn, *args) -> int:
    """dot_generals the function runs (a scan body's counted once per layer)."""

    def count(jaxpr, times):
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                n += times
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub, times * eqn.params.get("length", 1))
        return n

    return count(jax.make_jaxpr(fn)(*args).jaxpr, 1)


@pytest.mark.parametrize("remat", [False, True])
def test_the_two_passes_give_the_pullbacks_gradients_exactly(remat):
    for seed in (0, 7):
        cut, backward, res, g, g_stats = _cut(seed, remat)
        (g_x,), saved = jax.jit(cut.first)(*res, g, g_stats)
        g_w = jax.jit(cut.second)(res, saved)
        want = backward(res, g, g_stats)
        np.testing.assert_array_equal(g_x, want[0])
        for got, ref in zip(g_w, want[1:], strict=True):
            np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("remat", [False, True])
def test_each_backward_matmul_runs_once_and_the_weight_pass_reads_per_layer_cotangents(remat):
    cut, backward, res, g, g_stats = _cut(0, remat)
    _, saved = cut.first(*res, g, g_stats)
    first = _dots(lambda *a: cut.first(*a), *res, g, g_stats)
    second = _dots(lambda r, s: cut.second(r, s), res, saved)
    # Per layer: B runs du = dy @ down^T and the scaled input's gradient from up's and gate's
    # (after their forward matmuls again, under remat: tanh's gradient and the product's read
    # them); W runs down's, up's and gate's.
    assert (first, second) == ((5 if remat else 3) * L, 3 * L)
    assert first + second == _dots(backward, res, g, g_stats)
    # What W reads from B, stacked over the layers: the cotangents at the three matmuls' outputs
    # and, under remat, the matmuls' recomputed inputs, each once: the scaled input once for up and
    # gate, the gated product (not the two factors only W would multiply); `scale`'s gradient
    # leaves B finished per layer (a row, not the two activations it is summed from). Without
    # remat the inputs are the forward's residuals, which W is given, and W sums `scale`'s
    # gradient from one of them and the cotangent at the scaled input.
    shapes = sorted(a.shape for a in saved)
    cotangents = [(L, B, D), (L, B, F), (L, B, F)]
    if remat:
        assert shapes == sorted([*cotangents, (L, B, D), (L, B, F), (L, D)])
    else:
        assert shapes == sorted([*cotangents, (L, B, D)])
