"""Mixture of experts: the router on a hand-computed case, capacity == dropless when nothing drops,
the CPU grouped matmul in tiles == ragged_dot,
expert parallelism (both paths, with fsdp and tensor) equal to one device, all-to-all in the HLO,
metrics, expert-parameter bytes, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_training
from flax import nnx

from spmd.analysis import aot, hlo
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core import logical
from spmd.models.llama import Llama, count_params
from spmd.models.moe import GROUP_TILE, MoE, dispatch_masks, grouped_swiglu, route

LOGITS = np.array(
    [
        [
            [2.0, 1.0, 0.0, -1.0],  # token 0: experts 0, 1
            [0.0, 3.0, 1.0, 0.0],  # token 1: experts 1, 2
            [0.0, 2.0, 0.0, 1.0],
        ]
    ]
)  # token 2: experts 1, 3


def test_router_top_k_weights_and_losses_by_hand():
    r = route(jnp.asarray(LOGITS), top_k=2)
    np.testing.assert_array_equal(r.experts_BTk[0], [[0, 1], [1, 2], [1, 3]])
    e, e2, e3 = np.e, np.e**2, np.e**3
    np.testing.assert_allclose(
        r.weights_BTk[0],
        [[e2 / (e2 + e), e / (e2 + e)], [e3 / (e3 + e), e / (e3 + e)], [e2 / (e2 + e), e / (e2 + e)]],
        rtol=1e-6,
    )
    probs = np.exp(LOGITS[0]) / np.exp(LOGITS[0]).sum(-1, keepdims=True)
    f = np.array([1, 3, 1, 1]) / 6  # share of the 6 token-choices each expert got
    np.testing.assert_allclose(r.aux_loss, 4 * np.sum(f * probs.mean(0)), rtol=1e-6)
    lse = np.log(np.exp(LOGITS[0]).sum(-1))
    np.testing.assert_allclose(r.z_loss, np.mean(lse**2), rtol=1e-6)
    # Sigmoid scores pick by sigmoid (same order here) and normalise the chosen two.
    s = route(jnp.asarray(LOGITS), top_k=2, score="sigmoid")
    np.testing.assert_array_equal(s.experts_BTk, r.experts_BTk)
    sig = 1 / (1 + np.exp(-np.array([2.0, 1.0])))
    np.testing.assert_allclose(s.weights_BTk[0, 0], sig / sig.sum(), rtol=1e-6)


def test_capacity_drops_second_choices_then_later_tokens():
    r = route(jnp.asarray(LOGITS), top_k=2)
    # One slot per expert: first choices in token order take e0, e1; token 2's first choice (e1)
    # is full. Second choices: token 0's e1 is full; token 1's e2 and token 2's e3 are free.
    dispatch, combine, keep = dispatch_masks(r.experts_BTk, r.weights_BTk, 4, 1)
    np.testing.assert_array_equal(keep[0].any(-1), [[True, True, False], [False, True, True]])  # (k, T)
    np.testing.assert_array_equal(dispatch[0, :, :, 0], [[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_allclose(combine[0, 1, :, 0], [0, r.weights_BTk[0, 1, 0], r.weights_BTk[0, 1, 1], 0])
    # Two slots: only token 0's second choice (e1, third in line) is dropped.
    _, _, keep = dispatch_masks(r.experts_BTk, r.weights_BTk, 4, 2)
    assert int(keep.sum()) == 5 and not bool(keep[0, 1, 0].any())


def test_capacity_without_drops_equals_dropless():
    cfg = load_config("tiny-moe").model
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 32, cfg.d_model)), jnp.float32)
    outs, grads = {}, {}
    for dispatch in ("capacity", "dropless"):
        # capacity_factor E/k gives every expert a slot for every token: nothing can drop.
        moe = dataclasses.replace(
            cfg.moe, dispatch=dispatch, capacity_factor=cfg.moe.n_experts / cfg.moe.top_k
        )
        c = dataclasses.replace(cfg, moe=moe)
        with nnx.use_eager_sharding(False):
            model = MoE(c, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)

        def f(params, x):
            out, stats = nnx.merge(graphdef, params)(x)
            return jnp.sum(out * jnp.cos(out)), (out, stats)

        (_, (outs[dispatch], stats)), (grads[dispatch], dx) = jax.value_and_grad(
            f, argnums=(0, 1), has_aux=True
        )(params, x)
        grads[dispatch] = (grads[dispatch], dx)
        assert float(stats.sums["moe_dropped"]) == 0
    np.testing.assert_allclose(outs["capacity"], outs["dropless"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads["capacity"]), jax.tree.leaves(grads["dropless"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def moe_reference():
    """10 steps of tiny-moe on one device, for each dispatch path."""
    return {
        d: run_training(
            load_config("tiny-moe", [f"moe.dispatch={d}"]), "", "dp", 10, devices=jax.devices()[:1]
        )
        for d in ("capacity", "dropless")
    }


# Both dispatches on the plain expert layout; each mixed layout with one of them (the dispatch
# code does not depend on which other axes are there).
@pytest.mark.parametrize(
    "dispatch,rules,mesh",
    [
        ("capacity", "ep", "expert=4"),
        ("dropless", "ep", "expert=4"),
        ("capacity", "fsdp_ep", "fsdp=2,expert=4"),
        ("dropless", "ep", "data=2,expert=2,tensor=2"),
    ],
)
def test_expert_parallel_equals_one_device(devices, moe_reference, dispatch, rules, mesh):
    ref_losses, ref_params, _ = moe_reference[dispatch]
    n = 4 if mesh == "expert=4" else 8
    losses, params, trainer = run_training(
        load_config("tiny-moe", [f"moe.dispatch={dispatch}"]), mesh, rules, 10, devices=devices[:n]
    )
    assert losses[-1] < losses[0] - 0.5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_expert_parallel_exchanges_tokens_with_all_to_all(devices, dispatch):
    setup = assemble("tiny-moe", "data=2,expert=4", "ep", overrides=[f"moe.dispatch={dispatch}"])
    counts = {(c["kind"], tuple(c["axes"])): c["count"] for c in aot.dry_run(setup)["collectives"]}
    assert counts.get(("all-to-all", ("expert",)), 0) >= 2, counts  # out to the experts and back


def test_moe_metrics_and_parameter_count(devices, moe_reference):
    _, params, trainer = moe_reference["capacity"]
    cfg = trainer.cfg
    assert sum(x.size for x in jax.tree.leaves(params)) == count_params(cfg.model)
    assert (
        set(params["moe_layers"]) and params["layers"]["mlp"]["w_gate_DF"].shape[0] == 1
    )  # 1 dense + 1 MoE layer
    state = trainer.init_state()
    from spmd.data.loader import make_batches

    _, m = trainer.train_step(state, make_batches(cfg, trainer.plan.batch_sharding).train_batch(0))
    m = jax.device_get(m)["aux"]
    choices = cfg.train.global_batch_size * cfg.train.seq_len * cfg.model.moe.top_k
    assert (
        0 <= m["moe_dropped_fraction"] < 1 and m["moe_aux_loss"] >= 1.0 - 1e-3
    )  # E * sum f P >= 1 (balanced: 1)
    assert 0 <= m["moe_expert_load_min"] <= choices / 8 <= m["moe_expert_load_max"] <= choices
    assert m["moe_router_z_loss"] > 0


def test_expert_parameters_split_over_expert_axis(devices):
    plan = assemble("small-moe", "expert=8", "ep").plan  # B=16, T=128
    experts = [p for p in plan.params if p.logical[:2] == ("layers", "expert")]  # stacked over layers
    assert len(experts) == 3  # gate, up, down
    total = sum(np.prod(p.shape) for p in experts)
    per_device = sum(np.prod(p.local_shape) for p in experts)
    assert experts and per_device <= 1.05 * total / 8


def test_errors(devices):
    from spmd.core.errors import UserError

    with pytest.raises(UserError, match=r"moe.top_k \(9\) must be between 1 and moe.n_experts \(8\)"):
        load_config("tiny-moe", ["moe.top_k=9"])
    cfg = load_config("tiny-moe", ["moe.n_experts=6"])
    with pytest.raises(
        UserError, match=r"moe.n_experts \(6\) does not divide by the expert mesh axes expert=4"
    ):
        assemble(cfg, "data=2,expert=4", "ep")


def test_decoder_with_moe_decodes_like_full_forward():
    from spmd.models.decoder import KVCache

    cfg = load_config("tiny-moe").model
    cfg = dataclasses.replace(
        cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=4.0)
    )  # nothing drops: 1 token at a time
    with nnx.use_eager_sharding(False):
        model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(1, 12)))
    full = model(tokens)
    cache = KVCache.empty(cfg, 1, 12)
    logits, cache = model(tokens[:, :8], jnp.arange(8)[None], cache)
    steps = [logits]
    for t in range(8, 12):
        logits, cache = model(tokens[:, t : t + 1], jnp.full((1, 1), t), cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "sizes",
    [
        [GROUP_TILE, 0, 3, GROUP_TILE + 1, 50, 0],  # whole tile, empty groups, one row past a tile
        [0, 0, 0, 0, 0, 300],  # one expert takes every row
        [10, 20, 30, 0, 0, 40],  # rows past the groups (as expert parallelism's empty slots) give 0
    ],
)
def test_grouped_swiglu_in_tiles_equals_ragged_dot(sizes):
    """On CPU the dropless experts run as tiles of one expert's rows; values and gradients equal
    ragged_dot's grouped matmuls (fresh random inputs)."""
    rng = np.random.default_rng()
    M, D, F, E = 300, 16, 24, len(sizes)
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    ws = [  # unit-variance activations through each layer
        jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[1]), jnp.float32)
        for shape in ((E, D, F), (E, D, F), (E, F, D))
    ]
    sizes_E = jnp.asarray(sizes, jnp.int32)
    dy = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)

    def ragged(x, wg, wu, wd):
        h = jax.nn.silu(jax.lax.ragged_dot(x, wg, sizes_E)) * jax.lax.ragged_dot(x, wu, sizes_E)
        return jax.lax.ragged_dot(h, wd, sizes_E)

    def tiled(x, wg, wu, wd):
        return grouped_swiglu(x, sizes_E, wg, wu, wd)

    def rel_err(a, b):  # fp32 rounding, relative to the array's scale
        return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))

    out, ref = tiled(x, *ws), ragged(x, *ws)
    assert rel_err(out, ref) <= 1e-5
    assert np.all(np.asarray(out)[sum(sizes) :] == 0)
    grads = jax.grad(lambda *a: jnp.sum(tiled(*a) * dy), argnums=(0, 1, 2, 3))(x, *ws)
    ref_grads = jax.grad(lambda *a: jnp.sum(ragged(*a) * dy), argnums=(0, 1, 2, 3))(x, *ws)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 1e-5

    # Tiles, not ragged_dot's dense lowering (every row times every expert): the three matmuls
    # over ceil(M / tile) + E tiles of rows instead of M rows times E experts.
    def flops(f):
        return hlo.matmul_flops(jax.jit(f).lower(x, *ws).compile().as_text())

    tiles = -(-M // GROUP_TILE) + E
    assert flops(tiled) == 3 * 2 * tiles * GROUP_TILE * D * F < flops(ragged) == 3 * 2 * M * E * D * F


def test_the_grouped_matmul_form_is_the_runs_lowering_not_the_hosts():
    """The model asks the active Lowering (spmd.assembly.policy decides it once per run), never the
    platform: on this CPU host, a run for GPU devices traces ragged_dot; outside a run the form is
    the one for JAX's default devices (tiles here)."""
    M, D, F, E = 256, 8, 16, 4
    x = jnp.ones((M, D), jnp.float32)
    ws = [jnp.ones(shape, jnp.float32) for shape in ((E, D, F), (E, D, F), (E, F, D))]
    sizes_E = jnp.asarray([64] * E, jnp.int32)

    def flops(lowering=None):
        def f(x, *ws):
            if lowering is None:
                return grouped_swiglu(x, sizes_E, *ws)
            with logical.lowered(lowering):
                return grouped_swiglu(x, sizes_E, *ws)

        return hlo.matmul_flops(jax.jit(f).lower(x, *ws).compile().as_text())

    tiles = 3 * 2 * (-(-M // GROUP_TILE) + E) * GROUP_TILE * D * F
    assert flops() == flops(logical.Lowering.for_platform("cpu")) == tiles
    assert flops(logical.Lowering.for_platform("gpu")) == 3 * 2 * M * E * D * F  # ragged_dot, densely here
    cpu, tpu = logical.Lowering.for_platform("cpu"), logical.Lowering.for_platform("tpu")
    assert (cpu.grouped_matmul, cpu.interpret, cpu.merge_batch_heads) == ("tiles", True, True)
    assert (tpu.grouped_matmul, tpu.interpret, tpu.merge_batch_heads) == ("ragged_dot", False, False)
