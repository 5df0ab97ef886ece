"""Flash (Pallas, interpret mode; in its GPU and its TPU block layout) and chunked attention against
the reference: forward and gradients, causal or not, GQA 1/2/4, packed sequences, lengths off the
block grid, fp32 and bf16."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_training

from spmd.analysis import hlo as hlo_lib
from spmd.assembly.config import load_config
from spmd.kernels.chunked_attention import chunked_attention_with_lse
from spmd.kernels.flash_attention import BlockSizes, attention_reference, flash_attention_with_lse
from spmd.models import attention
from spmd.platform import cpu_matmul

BLOCKS = BlockSizes(16, 16, 16, 16)
IMPLS = {
    "flash": lambda q, k, v, **kw: flash_attention_with_lse(q, k, v, block_sizes=BLOCKS, **kw),
    # The kernel in its TPU (Mosaic) block layout: heads-major, tiles of at least 128 (padded here);
    # checked on fewer cases (each pads to whole 128-position tiles: slower in interpret mode).
    "flash_tpu": lambda q, k, v, **kw: flash_attention_with_lse(q, k, v, tpu=True, **kw),
    "chunked": lambda q, k, v, **kw: chunked_attention_with_lse(q, k, v, chunk=16, **kw),
}
FP32 = [(c, g, s, 40) for c, g, s in itertools.product([True, False], [1, 2, 4], [False, True])] + [
    (True, 2, True, 32)
]
BF16 = [(True, 2, False, 40), (False, 4, True, 40)]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / np.abs(b).max()


def inputs(rng, T, groups, dtype, with_segments, B=2, K=2, H=16):
    q = jnp.asarray(rng.normal(size=(B, T, K * groups, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), axis=1)) if with_segments else None
    return q, k, v, seg


def check(impl, causal, groups, with_segments, T, dtype):
    rng = np.random.default_rng()  # fresh inputs every run
    q, k, v, seg = inputs(rng, T, groups, dtype, with_segments)
    w_o = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    w_l = jnp.asarray(rng.normal(size=(q.shape[0], q.shape[2], T)), jnp.float32)

    def loss(fn):
        def f(q, k, v):
            o, lse = fn(q, k, v, causal=causal, segment_ids_BT=seg)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(lse * w_l)

        return f

    # The reference runs in fp32 on the same (already rounded) inputs: it is the exact answer the kernel
    # approximates. A bf16 reference is itself off by up to ~1e-2 in dv (40 seeds: max 0.0093 against
    # fp32), so kernel-vs-bf16-reference compared two noisy answers and failed now and then.
    exact = [x.astype(jnp.float32) for x in (q, k, v)]
    (o, lse) = IMPLS[impl](q, k, v, causal=causal, segment_ids_BT=seg)
    (ro, rlse) = attention_reference(*exact, causal=causal, segment_ids_BT=seg)
    tol = TOL[dtype]
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (2, q.shape[2], T)
    assert rel_err(o, ro) <= tol and rel_err(lse, rlse) <= tol
    grads = jax.grad(loss(IMPLS[impl]), argnums=(0, 1, 2))(q, k, v)
    ref_grads = jax.grad(loss(attention_reference), argnums=(0, 1, 2))(*exact)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype
        assert rel_err(g, r) <= tol, f"d{name}: {rel_err(g, r)}"


@pytest.mark.parametrize("impl", ["chunked", "flash"])
@pytest.mark.parametrize(
    "causal,groups,segments,T", FP32, ids=[f"causal{c}-G{g}-seg{s}-T{t}" for c, g, s, t in FP32]
)
def test_fp32_matches_reference(impl, causal, groups, segments, T):
    check(impl, causal, groups, segments, T, jnp.float32)


SPLASH = [(True, 1, False, jnp.float32), (True, 4, True, jnp.float32), (False, 2, True, jnp.float32),
          (True, 2, True, jnp.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(
    "causal,groups,segments,dtype",
    SPLASH,
    ids=[f"causal{c}-G{g}-seg{s}-{jnp.dtype(d).name}" for c, g, s, d in SPLASH],
)
def test_splash_matches_reference(causal, groups, segments, dtype):
    """JAX's splash attention behind our signature (interpret mode): GQA without repeating K/V,
    packed documents by segment ids, its queries scaled before the kernel; forward and gradients
    against the fp32 reference on the same rounded inputs, fresh every run."""
    from spmd.kernels.splash_attention import splash_attention

    rng = np.random.default_rng()
    q, k, v, seg = inputs(rng, 256, groups, dtype, segments, B=1, H=32)
    w_o = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    exact = [x.astype(jnp.float32) for x in (q, k, v)]

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w_o)

    ours = functools.partial(splash_attention, causal=causal, segment_ids_BT=seg, interpret=True)
    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, segment_ids_BT=seg)[0]  # noqa: E731
    o = ours(q, k, v)
    assert o.dtype == dtype and o.shape == q.shape and rel_err(o, ref(*exact)) <= TOL[dtype]
    grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, jax.grad(loss(ref), argnums=(0, 1, 2))(*exact)):
        assert g.dtype == dtype and rel_err(g, r) <= TOL[dtype], f"d{name}: {rel_err(g, r)}"


@pytest.mark.parametrize("T,chunk", [(64, 64), (130, 64), (1024, 128)])
@pytest.mark.parametrize("causal,segments", [(True, False), (False, True)])
def test_chunked_compiled_with_onednn_matches_reference(T, chunk, causal, segments):
    """As the CPU train step compiles it (cpu.matmul=onednn): one tile, a partial last tile,
    and 8 x 8 tiles, where the kernel before this one got the key gradients 100x off (a dot over
    all 1,024 queries times the scale, fused into oneDNN: spmd/platform/cpu_matmul.py)."""
    rng = np.random.default_rng()
    q, k, v, seg = inputs(rng, T, 2, jnp.float32, segments, B=1, H=32)
    w_o = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def grads(fn, jit):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, causal=causal, segment_ids_BT=seg)[0] * w_o)  # noqa: E731
        return jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    ours = functools.partial(chunked_attention_with_lse, chunk=chunk)
    (value, got), (ref_value, ref) = (
        grads(ours, cpu_matmul.raw_onednn_jit),
        grads(attention_reference, jax.jit),
    )
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value)) + 1e-3
    for name, g, r in zip("qkv", got, ref):
        assert rel_err(g, r) <= 1e-5, f"d{name}: {rel_err(g, r)}"


@pytest.mark.parametrize("impl", ["chunked", "flash"])
@pytest.mark.parametrize(
    "causal,groups,segments,T", BF16, ids=[f"causal{c}-G{g}-seg{s}-T{t}" for c, g, s, t in BF16]
)
def test_bf16_matches_reference(impl, causal, groups, segments, T):
    check(impl, causal, groups, segments, T, jnp.bfloat16)


@pytest.mark.parametrize(
    "groups,segments,T", [(1, False, 200), (2, True, 200), (4, False, 130), (2, False, 1030)]
)
def test_xla_causal_query_blocks_match_reference(groups, segments, T):
    """Causal xla attention past CAUSAL_BLOCK_MIN runs as query blocks that skip the masked keys
    (partial last block; T=1030: 8 blocks of 129): forward and gradients equal the reference's."""
    assert T > attention.CAUSAL_BLOCK_MIN
    rng = np.random.default_rng()
    q, k, v, seg = inputs(rng, T, groups, jnp.float32, segments, B=1)
    w_o = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w_o)

    ours = lambda q, k, v: attention.xla_attention(q, k, v, causal=True, segment_ids_BT=seg)  # noqa: E731
    ref = lambda q, k, v: attention_reference(q, k, v, causal=True, segment_ids_BT=seg)[0]  # noqa: E731
    assert rel_err(ours(q, k, v), ref(q, k, v)) <= 1e-5
    grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
        assert rel_err(g, r) <= 1e-5, f"d{name}: {rel_err(g, r)}"
    # The blocks skip the masked keys: fewer dot FLOPs than the full T x T attention.
    hlo = jax.jit(ours).lower(q, k, v).compile().as_text()
    full = 2 * 2 * q.shape[2] * T * T * q.shape[3]  # QK^T and PV over every key
    assert hlo_lib.matmul_flops(hlo) < 0.8 * full


def test_cpu_attention_backward_matches_autodiff():
    """spmd.models.attention.softmax_attention_few_passes (the merged layout's attention on CPU, with its own
    backward): forward bit-identical to the plain form; in fp32 its gradients equal autodiff's to
    rounding; in bf16 their error against an fp32 computation stays at bf16 rounding (ds is rounded
    to bf16 before its dots, as flash attention does). Compiled as train steps are on CPU (dots in
    oneDNN, spmd/platform/cpu_matmul.py): no dot is left to Eigen, and dq, dk and dv leave their dots in
    bf16, where autodiff's dq and dk dots give fp32, which oneDNN runs on operands converted to fp32
    (the point of it)."""
    rng = np.random.default_rng()
    b, Q, S, H = 8, 96, 64, 32
    q32, k32, v32 = (jnp.asarray(rng.normal(size=(b, n, H)), jnp.float32) for n in (Q, S, S))
    mask = jnp.asarray(rng.random((1, Q, S)) < 0.7).at[:, :, 0].set(True)
    w_o = jnp.asarray(rng.normal(size=(b, Q, H)), jnp.float32)
    ours = attention.softmax_attention_few_passes

    def plain(*args):
        return attention._softmax_attention(*args)[0]

    def grads(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v, mask, H**-0.5).astype(jnp.float32) * w_o)  # noqa: E731
        return cpu_matmul.jit(jax.grad(loss, argnums=(0, 1, 2)), "onednn")

    np.testing.assert_array_equal(ours(q32, k32, v32, mask, H**-0.5), plain(q32, k32, v32, mask, H**-0.5))
    truth = grads(plain)(q32, k32, v32)
    for name, g, r in zip("qkv", grads(ours)(q32, k32, v32), truth):
        assert rel_err(g, r) <= 1e-5, f"fp32 d{name}: {rel_err(g, r)}"
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
    for name, g, r, a in zip("qkv", grads(ours)(q16, k16, v16), truth, grads(plain)(q16, k16, v16)):
        l2 = lambda x: np.linalg.norm(np.asarray(x, np.float32) - np.asarray(r)) / np.linalg.norm(r)  # noqa: E731
        assert g.dtype == jnp.bfloat16 and l2(g) <= 2**-6, f"bf16 d{name}: {l2(g)} (autodiff {l2(a)})"

    def gradient_dots(f):
        """(whether the entry computation has a plain (Eigen) dot, output dtypes of the dots
        shaped like dq, dk or dv)."""
        text = grads(f).lower(q16, k16, v16).compile().as_text()
        shapes = {f"[{b},{Q},{H}]", f"[{b},{S},{H}]"}
        outs = re.findall(r"= (\w+)(\[[\d,]+\])\{[\d,]*\} dot\(", text)
        return " dot(" in text.split("\nENTRY")[1], sorted(dt for dt, shape in outs if shape in shapes)

    assert gradient_dots(ours) == (False, ["bf16", "bf16", "bf16"])
    assert "f32" in gradient_dots(plain)[1], "autodiff's gradient dots give bf16 now: re-measure"


LAYOUTS = [(True, 2, False, 40), (False, 4, True, 40), (True, 2, True, 150)]


@pytest.mark.parametrize(
    "causal,groups,segments,T", LAYOUTS, ids=[f"causal{c}-G{g}-seg{s}-T{t}" for c, g, s, t in LAYOUTS]
)
def test_xla_attention_with_batch_and_heads_kept_apart_matches_reference(causal, groups, segments, T):
    """The xla attention off CPU keeps B and K as two batch axes of its dots (so that data and
    tensor splits survive GSPMD); forced here on CPU, forward and gradients equal the reference's,
    as the merged (B*K) form's do (T=150: causal query blocks)."""
    rng = np.random.default_rng()
    q, k, v, seg = inputs(rng, T, groups, jnp.float32, segments)
    w_o = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w_o)

    def ours(merged):
        return lambda q, k, v: attention.xla_attention(
            q, k, v, causal=causal, segment_ids_BT=seg, merge_batch_heads=merged
        )

    ref = lambda q, k, v: attention_reference(q, k, v, causal=causal, segment_ids_BT=seg)[0]  # noqa: E731
    ref_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for merged in (False, True):
        assert rel_err(jax.jit(ours(merged))(q, k, v), ref(q, k, v)) <= 1e-5
        grads = jax.jit(jax.grad(loss(ours(merged)), argnums=(0, 1, 2)))(q, k, v)
        for name, g, r in zip("qkv", grads, ref_grads):
            assert rel_err(g, r) <= 1e-5, f"merged={merged} d{name}: {rel_err(g, r)}"
    # With positions (decoding: padded slots at -1), both layouts mask the same keys.
    qpos = jnp.asarray(rng.integers(0, T, size=(2, T)))
    kpos = jnp.where(jnp.asarray(rng.random(size=(2, T))) < 0.2, -1, jnp.arange(T)[None])
    out = [
        attention.xla_attention(q, k, v, q_positions_BT=qpos, k_positions_BS=kpos, merge_batch_heads=m)
        for m in (False, True)
    ]
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-6)


TPU_LAYOUT = [(True, 1, False, 40), (False, 2, True, 40), (True, 4, True, 150)]


@pytest.mark.parametrize(
    "causal,groups,segments,T", TPU_LAYOUT, ids=[f"causal{c}-G{g}-seg{s}-T{t}" for c, g, s, t in TPU_LAYOUT]
)
def test_tpu_layout_fp32_matches_reference(causal, groups, segments, T):
    """The TPU layout, its dK/dV one call whose last grid axis adds each query head of a group."""
    check("flash_tpu", causal, groups, segments, T, jnp.float32)


def test_tpu_layout_bf16_matches_reference():
    check("flash_tpu", True, 4, True, 150, jnp.bfloat16)


@pytest.mark.parametrize(
    "causal,groups,segments,T", FP32, ids=[f"causal{c}-G{g}-seg{s}-T{t}" for c, g, s, t in FP32]
)
def test_cudnn_path_matches_reference(causal, groups, segments, T):
    """`cudnn` is jax.nn.dot_product_attention with our GQA layout and a dense segment mask; run
    here through the same call's XLA implementation (no cuDNN on this host), forward and grads."""
    rng = np.random.default_rng()
    q, k, v, seg = inputs(rng, T, groups, jnp.float32, segments)
    w_o = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w_o)

    ours = functools.partial(
        attention.cudnn_attention, causal=causal, segment_ids_BT=seg, implementation="xla"
    )

    def reference(q, k, v):
        return attention_reference(q, k, v, causal=causal, segment_ids_BT=seg)[0]

    assert rel_err(ours(q, k, v), reference(q, k, v)) <= 1e-5
    grads = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    for name, g, r in zip("qkv", grads, jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)):
        assert rel_err(g, r) <= 1e-5, f"d{name}: {rel_err(g, r)}"


def test_cudnn_is_refused_where_it_cannot_run(devices):
    from spmd.assembly import policy
    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    assert policy.attention("cudnn", 2048, "gpu", "bfloat16") == "cudnn"
    with pytest.raises(UserError, match="runs in bfloat16 or float16, and model.dtype is float32"):
        policy.attention("cudnn", 2048, "gpu", "float32")
    with pytest.raises(UserError, match="this run's devices are cpu: use xla, chunked, pallas or auto"):
        assemble(load_config("tiny", ["model.attention_impl=cudnn"]), "fsdp=8", "fsdp")


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=48)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        BlockSizes(num_warps=3)
    with pytest.raises(ValueError, match="num_stages must be positive"):
        BlockSizes(num_stages=0)


def test_auto_on_a_gpu_runs_what_was_measured_fastest_there(monkeypatch, tmp_path):
    """The measured table (kernels/tuned.toml): the nearest sequence length of the same device
    kind, dtype and head dim decides; nothing measured, or packed documents: the flash kernel."""
    from spmd.assembly import policy
    from spmd.kernels import tuning

    table = tuning.entries()
    assert {e.device_kind for e in table} == {"NVIDIA H200"}
    assert policy.attention("auto", 8192, "gpu", "bfloat16", "NVIDIA H200", 128) == "cudnn"
    why = policy.auto_reason(6000, "gpu", "bfloat16", "NVIDIA H200", 128, False)
    assert why.startswith("measured on NVIDIA H200 at T 8192, H 128: cudnn 464, pallas 168")
    assert policy.attention("auto", 8192, "gpu", "float32", "NVIDIA H200", 128) == "pallas"
    assert policy.attention("auto", 8192, "gpu", "bfloat16", "NVIDIA H100", 128) == "pallas"
    assert "not measured on NVIDIA H100" in policy.auto_reason(
        8192, "gpu", "bfloat16", "NVIDIA H100", 128, False
    )
    assert policy.attention("auto", 8192, "gpu", "bfloat16", "NVIDIA H200", 128, packed=True) == "pallas"
    # What gpu_check.py writes reads back as it was, and the kernel takes its blocks.
    tuned = tuning.Measured(
        "cpu", "float32", 16, 64, "pallas", {"pallas": 1.0}, {"block_q": 16, "num_warps": 4}, "t"
    )
    path = tmp_path / "tuned.toml"
    path.write_text(tuning.to_toml([tuned]))
    assert tuning.entries(path) == (tuned,)
    monkeypatch.setattr(tuning, "entries", lambda: (tuned,))
    # The run's policy reads them once; the model's kernel takes them from the active Lowering.
    assert policy.flash_blocks("float32", "cpu", 16, 48) == (("block_q", 16), ("num_warps", 4))
    assert policy.flash_blocks("float32", "cpu", 32, 48) == ()
    cfg = load_config("tiny", ["model.dtype=float32", "model.attention_impl=pallas", "train.seq_len=48"])
    lowering = policy.resolve(cfg, "cpu", "cpu").lowering
    assert BlockSizes(**dict(lowering.flash_blocks)) == BlockSizes(block_q=16, num_warps=4)
    assert lowering.to_json()["flash_blocks"] == {"block_q": 16, "num_warps": 4}


def test_selection():
    from spmd.assembly import policy
    from spmd.core.errors import UserError

    assert policy.attention("auto", 64, "cpu") == "xla"
    assert policy.attention("auto", 4096, "cpu") == "chunked"
    assert policy.attention("auto", 64, "gpu") == "pallas"
    assert policy.attention("pallas", 64, "tpu") == policy.attention("auto", 64, "tpu") == "pallas_tpu"
    assert policy.attention("auto", 8192, "tpu") == policy.attention("splash", 8192, "tpu") == "splash"
    assert "not a multiple of splash's 128-position block" in policy.auto_reason(
        1000, "tpu", "bfloat16", "", 128, False
    )
    for platform, seq, message in (
        ("gpu", 8192, "splash is JAX's TPU kernel"),
        ("tpu", 1000, "a multiple of 128"),
    ):
        with pytest.raises(UserError, match=message):
            policy.attention("splash", seq, platform)
    for requested, platform, note in (("pallas", "cpu", "interpret mode"), ("auto", "tpu", "Mosaic")):
        choices = policy.Choices(
            platform, requested, policy.attention(requested, 64, platform), "xla", "xla", None, None, False
        )
        assert note in choices.describe_attention()


@pytest.mark.parametrize("impl", ["pallas", "chunked"])
def test_model_trains_like_xla(single_device_run, devices, impl):
    """Under tensor parallelism too: the Pallas kernel runs per shard through shard_map."""
    cfg = load_config("tiny", [f"model.attention_impl={impl}"])
    losses, params, _ = run_training(cfg, "data=4,tensor=2", "tp", 10)
    ref_losses, ref_params, _ = single_device_run
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)


def test_chunked_train_step_memory_grows_linearly(devices):
    """Compiled, not run: doubling T at most doubles (plus slack) the chunked step's temporaries,
    while xla attention's quadruple. Guards against residuals that bring back O(T^2)."""
    from spmd.assembly.setup import assemble

    def temp_bytes(impl, T):
        sets = [f"train.seq_len={T}", "train.global_batch_size=1", f"model.attention_impl={impl}"]
        trainer = assemble("tiny", "", "dp", overrides=sets, devices=jax.devices()[:1]).trainer
        batch = trainer.abstract_batch(1, T)
        state = trainer.abstract_state
        return trainer.train_step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("chunked", 4096) / temp_bytes("chunked", 2048) < 2.2
    assert temp_bytes("xla", 4096) / temp_bytes("xla", 2048) > 3.5


def test_cpu_attention_keeps_the_scale_off_the_score_arrays():
    """The CPU path scales q before the logits' dot, and its backward keeps the scale off ds: with
    the scale on the (b, Q, S) logits XLA:CPU materialised the scalar as a (b, Q, S) broadcast, read
    by the dot's oneDNN fusion as a post-op (and again by ds), 2-6% of a train step. No broadcast of the scores' shape in forward+backward."""
    B, T, N, K, H = 2, 64, 4, 2, 32
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))

    def loss(q, k, v):
        return jnp.sum(attention.xla_attention(q, k, v, causal=False, merge_batch_heads=True) ** 2)

    fwd_bwd = cpu_matmul.raw_onednn_jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = fwd_bwd.lower(q, k, v).compile().as_text()
    scores = f"f32[{B * K},{(N // K) * T},{T}]"
    broadcasts = re.findall(r"%?wrapped_broadcast[\w.]* = (\S+) ", text)  # their shapes
    assert not [s for s in broadcasts if s.startswith(scores)], broadcasts
    ref = jax.grad(
        lambda q, k, v: jnp.sum(attention_reference(q, k, v, causal=False)[0] ** 2), argnums=(0, 1, 2)
    )
    for ours, theirs in zip(fwd_bwd(q, k, v), ref(q, k, v)):
        assert rel_err(ours, theirs) < TOL[jnp.float32]
