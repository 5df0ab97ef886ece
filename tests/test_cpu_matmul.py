"""cpu.matmul: CPU train and eval steps run their matmuls in oneDNN where the CPU multiplies the
compute dtype in hardware (spmd/platform/cpu_matmul.py)."""

import re
import textwrap
import warnings

import jax
import numpy as np
import pytest
from conftest import run_fresh

from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError

BF16 = ["model.dtype=bfloat16", "train.global_batch_size=4", "train.seq_len=32"]
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ", re.M)
_LIBRARY_CALL = re.compile(r"calls=%([\w.\-]+).*\"kind\":\"__(onednn|ynn|xnn)_fusion\"")


def _programs(setting):
    overrides = [*BF16, f"cpu.matmul={setting}"]
    setup = assemble("tiny", "", "dp", overrides=overrides, devices=jax.devices()[:1])
    trainer, batches = setup.trainer, setup.batches()
    state, batch = trainer.init_state(), batches.train_batch(0)
    step = trainer.train_step.lower(state, batch).compile()
    evaluate = trainer.eval_step.lower(state["params"], batches.eval_batch(0)).compile()
    _, metrics = step(state, batch)
    return step.as_text(), evaluate.as_text(), float(metrics["loss"])


def _dots_by_library(text):
    """How many of the program's dots each library runs: 'eigen' for a dot that no library
    fusion calls (XLA:CPU's own dot thunk)."""
    library = {m.group(1): m.group(2) for m in _LIBRARY_CALL.finditer(text)}
    counts = {}
    for block in text.split("\n\n"):
        name = _COMPUTATION.search(block)
        n = block.count(" dot(")
        if name and n:
            key = library.get(name.group(1), "eigen")
            counts[key] = counts.get(key, 0) + n
    return counts


def test_cpu_steps_run_their_matmuls_in_onednn_and_compute_the_same_loss():
    """With `onednn` the dots of the bf16 train step and of the eval step run in
    oneDNN (a few that give fp32 from bf16, attention's dp, may stay in YNNPACK), the weight
    gradients x^T g included, none in Eigen; with `xla` XLA:CPU keeps its own libraries and hands
    those to Eigen. The first step's loss is the same computation either way (equal to fp32
    rounding of the sums)."""
    (step, evaluate, loss), (step_xla, evaluate_xla, loss_xla) = _programs("onednn"), _programs("xla")
    for text in (step, evaluate):
        dots = _dots_by_library(text)
        assert "eigen" not in dots and dots["onednn"] > dots.get("ynn", 0)
    assert "onednn" not in _dots_by_library(step_xla) and "onednn" not in _dots_by_library(evaluate_xla)
    assert _dots_by_library(step_xla).get("eigen", 0) > 0
    np.testing.assert_allclose(loss, loss_xla, rtol=1e-6)


DROPPED_PROGRAMS = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from spmd.platform import cpu_matmul
    from spmd.assembly import policy

    x = jnp.ones((1024, 1024))
    fallbacks = 0
    for i in range({n}):
        # a new oneDNN program each time, dropped by its caller while it runs ...
        g = cpu_matmul.jit(lambda a: jnp.sin(a @ a) @ a, "onednn")
        y = g(x)
        fallbacks += len(g.fallbacks)
        del g
        y.block_until_ready()
        # ... and one dropped right after its outputs are ready
        f = cpu_matmul.jit(lambda a: a @ a.T, "onednn")
        f(x).block_until_ready()
        fallbacks += len(f.fallbacks)
        del f
    print(json.dumps({{"programs": 2 * {n}, "fallbacks": fallbacks}}))
    """
)


def test_onednn_programs_may_be_dropped_while_they_run():
    """XLA aborts the process when a oneDNN program is freed as its execution ends (the fusion's
    runtime is still out of its pool: spmd/platform/cpu_matmul.py, KEPT_PROGRAMS); cpu_matmul.jit keeps
    such programs. Without that, this test failed 5 of 5 runs, and a script like it aborted within
    1-19 programs of the first kind and 61-137 of the second (the suite's CI run aborted once, in a
    test that dropped its program while it ran)."""
    assert run_fresh(DROPPED_PROGRAMS.format(n=60)) == {"programs": 120, "fallbacks": 0}


@pytest.mark.parametrize(
    "flags, dtype, library",
    [
        ((), "float32", "onednn"),
        (("avx512f",), "bfloat16", "xla"),  # oneDNN would emulate bf16: XLA's libraries convert to fp32
        (("avx512f", "avx512_bf16"), "bfloat16", "onednn"),
        (("avx512f", "amx_bf16"), "bfloat16", "onednn"),
        (("avx512f", "amx_bf16"), "float16", "xla"),
        (("avx512f", "avx512_fp16"), "float16", "onednn"),
    ],
)
def test_auto_runs_onednn_where_the_cpu_multiplies_the_dtype_in_hardware(monkeypatch, flags, dtype, library):
    from spmd.assembly import policy
    from spmd.platform import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: frozenset(flags))
    assert policy.matmul("auto", "cpu", dtype) == library
    assert policy.matmul_reason("auto", "cpu", dtype).startswith(
        "this CPU multiplies" if library == "onednn" else f"this CPU has no {dtype}"
    )
    # asked for by name, a library is what runs; off the CPU neither
    assert policy.matmul("onednn", "cpu", dtype) == "onednn" and policy.matmul("xla", "cpu", dtype) == "xla"
    assert policy.matmul("auto", "gpu", dtype) == "xla" and policy.matmul_reason("auto", "gpu", dtype) == ""
    cfg = load_config("tiny", [f"model.dtype={dtype}"])
    assert assemble(cfg, "", "dp", devices=jax.devices()[:1]).choices.matmul == library


def test_cpu_matmul_rejects_an_unknown_library():
    with pytest.raises(UserError, match=r"cpu.matmul must be one of auto, onednn, xla, got 'mkl'"):
        load_config("tiny", ["cpu.matmul=mkl"])


# XLA's other oneDNN mode, which fuses a dot's elementwise consumers into its oneDNN call
# (spmd/platform/cpu_matmul.py, _ONEDNN): what the tests below pin XLA computing wrong.
FUSED_DOTS = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
}


def fused_dots_jit(fun):
    from spmd.platform import cpu_matmul

    return cpu_matmul.keep(jax.jit(fun, compiler_options=FUSED_DOTS))


def test_onednn_gets_the_flash_backward_right_with_individual_dots_and_wrong_with_fused_ones():
    """The flash kernel's causal backward (interpret mode): with oneDNN's fused dots XLA gives dq
    of zeros and a wrong dk; with the individual dots cpu.matmul=onednn asks for, the same
    gradient as XLA's own libraries, so Pallas programs use oneDNN like the rest. When the fused
    form starts computing it right, the pin below fails: see spmd/platform/cpu_matmul.py, _ONEDNN."""
    from spmd.assembly import policy
    from spmd.kernels.flash_attention import BlockSizes, flash_backward, flash_forward
    from spmd.platform import cpu_matmul

    assert cpu_matmul.compiler_options(policy.matmul("onednn", "cpu")) is not None
    assert (
        cpu_matmul.compiler_options(policy.matmul("onednn", "gpu")) is None
        and cpu_matmul.compiler_options(policy.matmul("xla", "cpu")) is None
    )

    rng = np.random.default_rng()
    B, T, K, G, H = 2, 16, 2, 2, 16
    q = jax.numpy.asarray(rng.normal(size=(B, T, K * G, H)), np.float32)
    k, v, do = (jax.numpy.asarray(rng.normal(size=s), np.float32) for s in ((B, T, K, H),) * 2 + (q.shape,))
    bs = BlockSizes(16, 16, 16, 16)
    out, lse = flash_forward(q, k, v, None, True, H**-0.5, bs, True)

    def backward(q, k, v, out, lse, do):
        return flash_backward(q, k, v, None, out, lse, do, 0 * lse, True, H**-0.5, bs, True)

    args = (q, k, v, out, lse, do)
    truth = jax.jit(backward)(*args)
    ours = cpu_matmul.raw_onednn_jit(backward).lower(*args).compile()
    assert cpu_matmul.unsafe_onednn_fusions(ours.as_text()) == []
    assert ours.as_text().count(cpu_matmul.ONEDNN_FUSION_KIND) >= 4  # the kernel's dots, in oneDNN
    for name, g, r in zip("qkv", ours(*args), truth):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=f"d{name}")
    dq1, dk1, dv1 = fused_dots_jit(backward)(*args)
    np.testing.assert_allclose(dv1, truth[2], rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(truth[0])).max() > 0.1 and np.abs(np.asarray(truth[1])).max() > 0.1
    assert not np.asarray(dq1).any() and not np.asarray(dk1).any(), "fused oneDNN dots compute it now"


MOE = {"n_experts": 4, "top_k": 2, "d_ff_expert": 128}
GRADIENT_CASES = [
    ("float32", "xla", {}),
    ("float32", "chunked", {}),
    ("bfloat16", "xla", {}),
    ("float32", "xla", MOE),
    ("bfloat16", "xla", {**MOE, "dispatch": "dropless"}),
]


@pytest.mark.parametrize(
    "dtype,impl,moe",
    GRADIENT_CASES,
    ids=[f"{d}-{i}-{e.get('dispatch', 'capacity') if e else 'dense'}" for d, i, e in GRADIENT_CASES],
)
def test_model_gradients_with_onednn_equal_xlas(dtype, impl, moe):
    """The whole model's gradient (rolled layer scan, causal attention blocks, SwiGLU, RoPE) with
    oneDNN's dot fusions against XLA's own libraries, every parameter, dense and MoE: equal to
    fp32 rounding in fp32, within a few bf16 roundings in bf16 (relative L2; measured up to 7e-4).
    A miscomputed dot shows as an O(1) error in some parameter's gradient, as in the Pallas
    kernel's case above. (The parity tests compare layouts that all use oneDNN; this compares the
    libraries.)"""
    from flax import nnx

    from spmd.models.llama import Llama, LlamaConfig
    from spmd.models.moe import MoEConfig
    from spmd.parallel.sharding import init_params
    from spmd.platform import cpu_matmul

    cfg = LlamaConfig(
        dtype=dtype, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384, attention_impl=impl,
        moe=MoEConfig(**moe) if moe else None,
    )  # fmt: skip
    bound = 1e-5 if dtype == "float32" else 2**-7
    params = jax.jit(lambda: init_params(Llama, cfg, 0))()
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    tokens = jax.numpy.asarray(np.random.default_rng().integers(0, cfg.vocab_size, size=(4, 65)))

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(np.float32)
        logp = jax.numpy.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)
        return -jax.numpy.mean(logp)

    program = cpu_matmul.jit(jax.grad(loss), "onednn")
    ours = program(params)
    assert program.fallbacks == []  # the model's dots keep oneDNN (no fusion XLA gets wrong)
    xla = jax.jit(jax.grad(loss))(params)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(xla), strict=True):
        err = np.linalg.norm(np.asarray(g, np.float32) - np.asarray(r, np.float32)) / np.linalg.norm(
            np.asarray(r, np.float32)
        )
        assert err <= bound, f"{jax.tree_util.keystr(path)}: {err}"


def _dot_then(op, K):
    """A batched f32 dot summing over K elements, then `op` of its result in the same program."""
    rng = np.random.default_rng()
    a, b = (jax.numpy.asarray(rng.normal(size=s), np.float32) for s in ((4, 128, K), (4, K, 96)))
    c, r = (jax.numpy.asarray(rng.normal(size=s), np.float32) for s in ((4, 128, 96), (4, 128)))
    ops = {
        "scale": lambda y: y * 0.25,
        "row scale": lambda y: y * r[..., None],
        "row scale, then add": lambda y: y * r[..., None] + c,
        "add": lambda y: y + jax.numpy.exp(c),
        "add twice": lambda y: y + jax.numpy.exp(c) + r[..., None],
    }
    return (lambda a, b: ops[op](jax.numpy.einsum("bij,bjk->bik", a, b))), (a, b)


@pytest.mark.parametrize(
    "op,K,fused_wrong",
    [
        ("scale", 1024, True),
        ("row scale", 768, True),
        ("row scale", 512, False),
        ("row scale, then add", 64, True),
        ("add", 1024, False),
        ("add twice", 64, True),
    ],
)
def test_individual_onednn_dots_are_right_where_xla_gets_fused_ones_wrong(op, K, fused_wrong):
    """XLA (jax 0.12) fuses a dot's elementwise consumers into oneDNN's call in its fused mode and
    gets some of them wrong (pinned here, so that a fixed XLA shows); cpu_matmul.jit's programs
    call oneDNN for the dot alone and are right; and its guard (unsafe_onednn_fusions), given a
    program with fused dots, warns and compiles it with XLA's own libraries instead."""
    from spmd.platform import cpu_matmul

    f, args = _dot_then(op, K)
    truth = np.asarray(jax.jit(f)(*args))

    def err(out):
        return np.abs(np.asarray(out) - truth).max() / np.abs(truth).max()

    fused = fused_dots_jit(f).lower(*args).compile()
    assert (err(fused(*args)) > 0.5) == fused_wrong, f"fused oneDNN dots: error {err(fused(*args))}"
    assert cpu_matmul.unsafe_onednn_fusions(fused.as_text())  # a dot and its elementwise consumers

    ours = cpu_matmul.jit(f, "onednn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ours(*args)
        text = ours.lower(*args).compile().as_text()
    assert err(out) < 1e-5 and ours.fallbacks == []
    assert not any("XLA's own matmul libraries instead" in str(w.message) for w in caught)
    assert text.count(cpu_matmul.ONEDNN_FUSION_KIND) == 1 and cpu_matmul.unsafe_onednn_fusions(text) == []

    guarded = cpu_matmul.keep(cpu_matmul.CheckedJit(f, FUSED_DOTS, {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = guarded(*args)
        text = guarded.lower(*args).compile().as_text()
    assert err(out) < 1e-5 and guarded.fallbacks
    assert any("XLA's own matmul libraries instead" in str(w.message) for w in caught)
    assert cpu_matmul.ONEDNN_FUSION_KIND not in text


def test_chunked_attention_compiles_to_plain_onednn_dots():
    """The chunked kernel's dots run in oneDNN, each alone (no elementwise work fused in: what
    cpu.matmul=onednn asks XLA for), forward and backward over 4 tiles."""
    from spmd.kernels.chunked_attention import chunked_attention
    from spmd.platform import cpu_matmul

    q = jax.numpy.ones((1, 1024, 4, 32))
    k = v = jax.numpy.ones((1, 1024, 2, 32))

    def fwd_bwd(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: chunked_attention(q, k, v, causal=True), q, k, v)
        return vjp(o)

    text = cpu_matmul.jit(fwd_bwd, "onednn").lower(q, k, v).compile().as_text()
    assert text.count("__onednn_fusion") >= 6
    assert cpu_matmul.unsafe_onednn_fusions(text) == []
