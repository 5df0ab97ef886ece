"""KV-cache decoding against the full forward pass; sampling determinism; eval vs training's eval_loss."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_cli import spmd_train

from spmd.models.decoder import KVCache
from spmd.models.llama import Llama, LlamaConfig
from spmd.models.moe import MoEConfig
from spmd.parallel.sharding import abstract_model, init_params

CFG = LlamaConfig(dtype="float32")


# Interleaved: groups of one dense and one MoE layer, so a per-layer cache's numbering is checked.
MOE_CFG = dataclasses.replace(
    CFG, n_layers=4, moe=MoEConfig(n_experts=4, top_k=2, every=2, capacity_factor=2.0)
)


@pytest.mark.parametrize(
    "cfg,per_layer",
    [
        (CFG, False),
        (dataclasses.replace(CFG, scan_unroll=CFG.n_layers), False),
        (CFG, True),
        (MOE_CFG, False),
        (MOE_CFG, True),
    ],
    ids=["scanned", "unrolled", "per-layer cache", "moe", "moe per-layer cache"],
)
def test_kv_cache_decoding_equals_the_full_forward_pass(cfg, per_layer):
    graphdef, _ = abstract_model(Llama, cfg)
    params = jax.jit(lambda: init_params(Llama, cfg, 0))()
    model = nnx.merge(graphdef, params)
    rng = np.random.default_rng()
    tokens = rng.integers(0, 256, (3, 20))
    full = model(tokens)
    prefill = int(rng.integers(1, 10))
    cache = KVCache.empty(cfg, 3, 20, per_layer)
    logits, cache = model(tokens[:, :prefill], cache=cache)
    pieces = [logits]
    for t in range(prefill, 20):
        logits, cache = model(tokens[:, t : t + 1], positions_BT=jnp.full((3, 1), t), cache=cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, rtol=1e-5, atol=1e-5)
    assert isinstance(cache.k_LBKSH, tuple) == per_layer


@pytest.mark.parametrize("config,dtype", [("tiny", "float32"), ("tiny", "bfloat16"), ("tiny-moe", "float32")])
def test_decoding_on_cpu_copies_no_layer_weights(devices, config, dtype):
    """XLA:CPU copies a slice of a stacked array, which was every layer's weights and caches for
    every token: on CPU the sampler feeds each layer's weights and caches as arrays of their own
    (and the model, given per-layer caches, runs its layers as a Python loop), so no
    instruction of the token step makes an array of a layer weight's shape in the compute dtype,
    and a layer's cache is only written in place (in bfloat16 each weight was
    cast per token: the sampler casts them once); the split weights stack back to the originals,
    cast."""
    from spmd.assembly.setup import assemble
    from spmd.io.inference import Loaded, Sampler, stack_layers
    from spmd.parallel.sharding import path_str

    sets = [f"model.dtype={dtype}"]
    decode = assemble(
        config, "", "dp", overrides=sets, devices=devices[:1], optimizer=False, decoding=True, batch_size=1
    )
    n_layers = decode.cfg.model.n_layers
    plan = decode.plan
    params = jax.jit(lambda: plan.init_params(0), out_shardings=plan.param_shardings)()
    sampler = Sampler(Loaded(decode, 0, {}, params))
    # Matmul weights in the compute dtype, norm scales and the embedding as they are.
    kept = {p.path: jnp.dtype(dtype) if p.compute_cast else p.dtype for p in plan.params}
    cast = jax.tree_util.tree_map_with_path(lambda path, a: a.astype(kept[path_str(path)]), params)
    jax.tree.map(np.testing.assert_array_equal, stack_layers(sampler.params), cast)

    leaves = jax.tree_util.tree_leaves_with_path(params)
    layered = [a for path, a in leaves if path_str(path) in plan.layered and a.ndim >= 3]
    weight_dims = {d for a in layered for d in (a.shape, a.shape[1:])}
    cache = sampler.empty_cache(1, 4)
    assert isinstance(cache.k_LBKSH, tuple) and len(cache.k_LBKSH) == n_layers
    hlo = (
        sampler.decode.lower(sampler.params, np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), cache,
                             jax.random.key(0), 1, 0.8, 5)
        .compile()
        .as_text()
    )  # fmt: skip
    # (XLA:CPU itself widens a bfloat16 matrix-vector product's operands to float32: those
    # float32 converts are its own and stay.)
    element = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    layer_cache = cache.k_LBKSH[0].shape
    cache_dims = {layer_cache, (n_layers, *layer_cache)}
    made, cache_made = [], []
    for m in re.finditer(r"%(\S+) = (\w+)\[([\d,]*)\]\S* (\S+?)\(", hlo):
        name, element_type, op = m.group(1), m.group(2), m.group(4)
        dims = tuple(int(d) for d in m.group(3).split(",") if d)
        if element_type == element and dims in weight_dims and op not in ("parameter", "bitcast"):
            made.append(name)
        # A layer's cache is only written in place (no copy, no slice of a stacked cache).
        in_place = op == "dynamic-update-slice" or (op == "fusion" and "dynamic-update-slice" in name)
        if dims in cache_dims and op not in ("parameter", "bitcast") and not in_place:
            cache_made.append(name)
    assert not made, made
    assert not cache_made, cache_made


def test_left_padding_does_not_change_a_prompt(devices):
    """A short prompt padded on the left (as in a batch with a longer one) decodes as if alone."""
    graphdef, _ = abstract_model(Llama, CFG)
    params = jax.jit(lambda: init_params(Llama, CFG, 0))()
    model = nnx.merge(graphdef, params)
    prompt = np.random.default_rng().integers(0, 256, (1, 6))
    alone, _ = model(prompt, cache=KVCache.empty(CFG, 1, 6))
    padded = np.concatenate([np.zeros((1, 4), int), prompt], axis=1)
    positions = np.arange(10)[None] - 4
    together, _ = model(padded, positions_BT=positions, cache=KVCache.empty(CFG, 1, 10))
    np.testing.assert_allclose(together[:, 4:], alone, rtol=1e-5, atol=1e-5)


def run_script(name, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, "-m", f"spmd.cli.{name}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("infer") / "run"
    result = spmd_train(
        "--config",
        "tiny",
        "--mesh",
        "fsdp=4,tensor=2",
        "--rules",
        "fsdp_tp",
        "--host-devices",
        "8",
        "--steps",
        "20",
        "--eval-every",
        "10",
        "--checkpoint-every",
        "10",
        "--run-dir",
        str(run_dir),
    )
    assert result.returncode == 0, result.stderr
    return run_dir


def test_eval_equals_the_logged_eval_loss(run):
    logged = {
        r["step"]: r["eval_loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in r
    }
    for step in (10, 20):
        result = run_script(
            "eval",
            "--run-dir",
            str(run),
            "--step",
            str(step),
            "--host-devices",
            "8",
            "--mesh",
            "fsdp=4,tensor=2",
            "--json",
        )
        assert result.returncode == 0, result.stderr
        got = json.loads(result.stdout)
        assert got["step"] == step
        np.testing.assert_allclose(got["loss"], logged[step], rtol=1e-6)
        np.testing.assert_allclose(got["bits_per_byte"], logged[step] / np.log(2), rtol=1e-6)
    # On another mesh the reduction order changes, the value does not (beyond fp32 rounding).
    other = json.loads(
        run_script(
            "eval",
            "--run-dir",
            str(run),
            "--host-devices",
            "2",
            "--mesh",
            "data=2",
            "--rules",
            "dp",
            "--json",
        ).stdout
    )
    np.testing.assert_allclose(other["loss"], logged[20], rtol=1e-5)


def test_greedy_is_deterministic_and_mesh_independent(run):
    base = ["--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "24", "--temperature", "0"]
    one = run_script("sample", *base, "--host-devices", "1", "--mesh", "")
    tensor = run_script("sample", *base, "--host-devices", "2", "--mesh", "tensor=2", "--rules", "tp")
    fsdp = run_script("sample", *base, "--host-devices", "8", "--mesh", "fsdp=8")  # batch 1 padded to 8
    # Sequence-parallel rules decode too: one position per step, so the context axis splits the batch
    # and Megatron SP's tensor axis only splits heads and MLP.
    context = run_script(
        "sample", *base, "--host-devices", "8", "--mesh", "fsdp=2,context=4", "--rules", "cp_ring"
    )
    sp = run_script("sample", *base, "--host-devices", "2", "--mesh", "tensor=2", "--rules", "tp_sp")
    for r in (one, tensor, fsdp, context, sp):
        assert r.returncode == 0, r.stderr
    assert one.stdout.startswith("def ") and len(one.stdout) > len("def ") + 10
    assert one.stdout == tensor.stdout == fsdp.stdout == context.stdout == sp.stdout


def test_sampling_is_reproducible_with_a_seed_and_batches_prompts(run, tmp_path):
    (tmp_path / "prompts.txt").write_text("import \nclass A:\n")
    base = [
        "--run-dir",
        str(run),
        "--prompts-file",
        str(tmp_path / "prompts.txt"),
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--host-devices",
        "1",
        "--mesh",
        "",
    ]
    a, b = run_script("sample", *base, "--seed", "1"), run_script("sample", *base, "--seed", "1")
    c = run_script("sample", *base, "--seed", "2")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout != c.stdout
    assert a.stdout.count("=== sample") == 2 and "import " in a.stdout and "class A:" in a.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--run-dir", "{tmp}/none", "--prompt", "x"], "not found"),
        (["--run-dir", "{run}", "--prompt", "x" * 65], "longer than the model's context of 64 tokens"),
        (["--run-dir", "{run}", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--run-dir", "{run}", "--prompt", "x", "--step", "7"], "no committed checkpoint for step 7"),
    ],
)
def test_sample_errors(run, tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) for a in args]
    result = run_script("sample", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_a_byte_level_run_with_a_larger_vocabulary_samples(tmp_path, devices):
    """A run on bytes whose model has more than 256 ids (a preset such as llama-1b trained on the
    embedded corpus) records its tokenizer as bytes; sampling takes it at its word."""
    from spmd import run as run_lib
    from spmd.assembly.setup import assemble

    overrides = ["model.vocab_size=512", "train.steps=1", "train.eval_every=0"]
    run_lib.train(
        assemble("tiny", "fsdp=2", "fsdp", overrides=overrides, devices=devices[:2]), tmp_path / "run"
    )
    assert json.loads((tmp_path / "run" / "config.json").read_text())["tokenizer"]["name"] == "bytes"
    result = run_script("sample", "--run-dir", str(tmp_path / "run"), "--host-devices", "1", "--mesh", "fsdp=1",
                        "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")
