"""Hugging Face import/export against numbers transformers computed (tests/fixtures/hf, made by
tests/fixtures/make_hf_fixtures.py; neither torch nor transformers is needed here)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_ckpt_cli import one_error_line, spmd_ckpt

from spmd import start as start_lib
from spmd.assembly.config import config_from_json, load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.io import checkpoint as ckpt
from spmd.io import hf

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
NAMES = ["llama", "llama3", "mistral", "qwen2", "mixtral"]
FP32 = ["model.dtype=float32"]


def hf_tensors_of(directory: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each fixture imported once (fp32 compute) into its own run dir."""
    root = tmp_path_factory.mktemp("hf")
    for name in NAMES:
        hf.import_hf(str(FIXTURES / name), str(root / name), overrides=FP32)
    return root


def load(run_dir, mesh: str, rules: str, devices=None, overrides=()):
    directory, step = ckpt.locate(str(run_dir))
    cfg = config_from_json(ckpt.read_meta(directory, step)["run"]["config"])
    setup = assemble(cfg, mesh, rules, overrides=overrides, devices=devices, optimizer=False, batch_size=0)
    params, _ = ckpt.restore_params(directory, step, setup.plan.abstract_params)
    return setup, params


def logits(setup, params, tokens):
    plan = setup.plan

    @jax.jit
    def forward(params, tokens):
        with plan.activate():
            return nnx.merge(plan.graphdef, params)(tokens)

    return np.asarray(forward(params, tokens))


def assert_close_to(ours, theirs):
    """1e-5 relative to the logits' scale (a logit near 0 has no relative error to speak of)."""
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("name", NAMES)
def test_import_computes_transformers_logits_on_one_device(imported, name):
    ref = np.load(FIXTURES / name / "reference.npz")
    setup, params = load(imported / name, "", "dp", devices=jax.devices()[:1])
    assert_close_to(logits(setup, params, ref["tokens"]), ref["logits"])


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])
def test_import_computes_transformers_logits_on_fsdp_tensor_mesh(imported, name):
    ref = np.load(FIXTURES / name / "reference.npz")
    setup, params = load(imported / name, "fsdp=2,tensor=2", "fsdp_tp", devices=jax.devices()[:4])
    assert params["layers" if name != "mixtral" else "moe_layers"]["attn"]["wq_DNH"].sharding.spec != (
        jax.sharding.PartitionSpec()
    )
    assert_close_to(logits(setup, params, ref["tokens"]), ref["logits"])


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_greedy_decoding_equals_transformers_generate(imported, name):
    from spmd.io.inference import Loaded, Sampler

    ref = np.load(FIXTURES / name / "reference.npz")
    directory, step = ckpt.locate(str(imported / name))
    setup = assemble(
        config_from_json(ckpt.read_meta(directory, step)["run"]["config"]), "fsdp=2", "fsdp",
        devices=jax.devices()[:2], optimizer=False, decoding=True, batch_size=0,
    )  # fmt: skip
    params, meta = ckpt.restore_params(directory, step, setup.plan.abstract_params)
    sampler = Sampler(Loaded(setup, step, meta, params))
    out = sampler.generate(list(ref["prompt"]), ref["greedy"].shape[1], temperature=0.0, top_k=0, seed=0)
    np.testing.assert_array_equal(np.stack(out), ref["greedy"])


def test_llama3_fixture_exercises_rope_scaling(imported):
    """Without the llama3 frequencies the logits move far past the tolerance: the fixture has
    frequencies in every band, so the scaling is really tested."""
    ref = np.load(FIXTURES / "llama3" / "reference.npz")
    setup, params = load(
        imported / "llama3", "", "dp", devices=jax.devices()[:1], overrides=["model.rope_scaling=none"]
    )
    assert not np.allclose(logits(setup, params, ref["tokens"]), ref["logits"], rtol=1e-3, atol=1e-3)


def test_import_reads_both_rope_spellings_and_derives_the_config():
    new = json.loads((FIXTURES / "llama3" / "config.json").read_text())
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    params = new["rope_parameters"]
    old["rope_theta"] = params["rope_theta"]
    old["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    a, b = hf.model_fields(new, "new"), hf.model_fields(old, "old")
    assert a == b
    assert (a["head_dim"], a["tie_embeddings"], a["rope_scaling"], a["rope_original_max_position"]) == (
        16, True, "llama3", 32,
    )  # fmt: skip
    mixtral = hf.model_fields(json.loads((FIXTURES / "mixtral" / "config.json").read_text()), "m")
    moe = mixtral["moe"]
    assert (moe.n_experts, moe.top_k, moe.dispatch) == (4, 2, "dropless")
    assert hf.model_fields(json.loads((FIXTURES / "qwen2" / "config.json").read_text()), "q")["qkv_bias"]


@pytest.mark.parametrize("name", NAMES)
def test_export_round_trip_is_bit_exact(imported, tmp_path, name):
    out = tmp_path / "out"
    done = hf.export_hf(str(imported / name), str(out), max_shard_bytes=100_000)
    original, exported = hf_tensors_of(FIXTURES / name), hf_tensors_of(out)
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    if len(done["files"]) > 1:
        index = json.loads((out / hf.INDEX).read_text())
        assert sorted(index["weight_map"]) == sorted(original)
        assert all(f.stat().st_size <= 100_000 + 10_000 for f in out.glob("*.safetensors"))
    before = json.loads((FIXTURES / name / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    assert hf.model_fields(after, "exported") == hf.model_fields(before, "original")
    mapped = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "tie_word_embeddings", "rope_parameters", "num_local_experts", "num_experts_per_tok"]  # fmt: skip
    for key in mapped:
        assert after.get(key) == before.get(key), key
    assert (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").is_file() == (name == "llama")


def test_export_of_a_model_trained_on_8_devices_imports_to_identical_parameters(tmp_path):
    """Train `tiny` under fsdp_tp on 8 fake devices, export (as a Llama), import: every parameter
    equal bit for bit."""
    cfg = load_config("tiny")
    setup = assemble(cfg, "fsdp=4,tensor=2", "fsdp_tp")
    batches = setup.batches()
    state = setup.trainer.init_state()
    for step in range(2):
        state, _ = setup.trainer.train_step(state, batches.train_batch(step))
    writer = ckpt.Checkpointer(tmp_path / "run", cfg.checkpoint)
    writer.save(2, state, ckpt.step_meta(2, batches, cfg.train, setup.to_json()))
    writer.close()
    done = hf.export_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert done["architecture"] == "LlamaForCausalLM"
    hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "back"), mesh="data=8", rules="dp")
    _, params = load(tmp_path / "back", "fsdp=2,tensor=2", "fsdp_tp", devices=jax.devices()[:4])
    trained = jax.tree.map(np.asarray, state["params"])
    back = jax.tree.map(np.asarray, params)
    assert jax.tree.structure(trained) == jax.tree.structure(back)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_init_from_starts_a_fresh_optimizer_on_another_mesh_and_then_resumes_its_own(imported, tmp_path):
    directory, step = ckpt.locate(str(imported / "qwen2"))
    cfg = config_from_json(ckpt.read_meta(directory, step)["run"]["config"])
    setup = assemble(cfg, "fsdp=2,tensor=2", "fsdp_tp", devices=jax.devices()[:4],
                     overrides=["data.path=" + str(tokens_file(tmp_path))])  # fmt: skip
    batches = setup.batches()
    run_dir = tmp_path / "ft"
    start = start_lib.resume_or_init(setup.trainer, batches, run_dir, init_from=str(imported / "qwen2"))
    assert start.step == 0 and any("fresh optimizer" in n for n in start.notes)
    original = hf_tensors_of(FIXTURES / "qwen2")
    bq = np.asarray(start.state["params"]["layers"]["attn"]["bq_NH"])
    np.testing.assert_array_equal(bq[1].reshape(-1), original["model.layers.1.self_attn.q_proj.bias"])
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(start.state["opt_state"]) if np.ndim(x))
    state, _ = setup.trainer.train_step(start.state, batches.train_batch(0))
    writer = ckpt.Checkpointer(run_dir, cfg.checkpoint)
    writer.save(1, state, ckpt.step_meta(1, batches, cfg.train, setup.to_json()))
    writer.close()
    again = start_lib.resume_or_init(setup.trainer, batches, run_dir, init_from=str(imported / "qwen2"))
    assert again.step == 1  # a restart resumes the fine-tune, not the import
    with pytest.raises(UserError, match="holds parameters only.*--init-from"):
        start_lib.resume_or_init(setup.trainer, batches, imported / "qwen2")


def tokens_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "tokens128.npy"
    np.save(path, np.random.default_rng(0).integers(0, 128, 20_000).astype(np.uint16))
    return path


# --- bad input: error, nothing written ---------------------------------------------------------


def copy_fixture(tmp_path, name="llama") -> pathlib.Path:
    dst = tmp_path / f"hf_{name}"
    shutil.copytree(FIXTURES / name, dst)
    return dst


def refused(src, tmp_path, match: str, **kwargs):
    dest = tmp_path / "run"
    with pytest.raises(UserError, match=match):
        hf.import_hf(str(src), str(dest), **kwargs)
    assert not dest.exists() and not list(tmp_path.glob(".run.tmp*"))


def test_truncated_safetensors_is_refused(tmp_path):
    src = copy_fixture(tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(src, tmp_path, "not a readable safetensors file.*truncated")


def test_missing_shard_named_by_the_index_is_refused(tmp_path):
    src = copy_fixture(tmp_path, "mixtral")
    (src / "model-00002-of-00003.safetensors").unlink()
    refused(src, tmp_path, "names the shard model-00002-of-00003.safetensors, which is missing")


def test_config_that_does_not_match_the_tensors_is_refused(tmp_path):
    src = copy_fixture(tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (src / "config.json").write_text(json.dumps(config))
    refused(src, tmp_path, r"k_proj.weight has shape \[16, 32\] but config.json implies \[32, 32\]")


def test_unmapped_tensor_and_unsupported_architecture_are_refused(tmp_path):
    src = copy_fixture(tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)},
              str(src / "model.safetensors"))  # fmt: skip
    refused(src, tmp_path, "q_norm.weight has no place in this model")
    save_file(tensors, str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    refused(src, tmp_path, "architecture 'FalconForCausalLM' is not supported")
    mistral = {
        **config,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 8,
    }
    (src / "config.json").write_text(json.dumps(mistral))
    refused(src, tmp_path, "sliding-window attention")
    (src / "config.json").write_text(json.dumps({**mistral, "sliding_window": None}))
    hf.import_hf(str(src), str(tmp_path / "run"))  # the same weights import once the config is right


def test_export_refuses_what_no_hf_family_expresses(tmp_path):
    cfg = load_config("tiny-moe")  # shared experts, dense layers between MoE layers
    setup = assemble(cfg, "fsdp=1", "fsdp", devices=jax.devices()[:1])
    batches = setup.batches()
    writer = ckpt.Checkpointer(tmp_path / "run", cfg.checkpoint)
    writer.save(0, setup.trainer.init_state(), ckpt.step_meta(0, batches, cfg.train, setup.to_json()))
    writer.close()
    with pytest.raises(UserError, match="cannot export: shared experts"):
        hf.export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_import_errors_are_one_line_and_write_nothing(tmp_path):
    src = copy_fixture(tmp_path)
    (src / "model.safetensors").write_bytes(b"\x00" * 12)
    result = spmd_ckpt("import-hf", str(src), "--run-dir", str(tmp_path / "run"))
    assert "not a readable safetensors file" in one_error_line(result)
    assert not (tmp_path / "run").exists()
    good = spmd_ckpt("import-hf", str(FIXTURES / "llama"), "--run-dir", str(tmp_path / "ok"))
    assert good.returncode == 0, good.stderr
    again = spmd_ckpt("export-hf", str(tmp_path / "ok"), "--out", str(tmp_path / "ok"))
    assert "already holds files" in one_error_line(again)


# --- memory ------------------------------------------------------------------------------------

# VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's (pytest's) peak.
MEMORY_PROBE = """
import re, sys
sys.path.insert(0, {root!r})
from spmd.io import hf
hf.import_hf(sys.argv[1], sys.argv[2], mesh="fsdp=1", rules="dp")
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024)
"""


def big_embedding_model(directory: pathlib.Path, vocab: int) -> int:
    """A one-layer tied Llama whose embedding (vocab x 512 fp32) is nearly all of it."""
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    D, F = 512, 64
    config.update(vocab_size=vocab, hidden_size=D, intermediate_size=F, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True)  # fmt: skip
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, D), np.float32),
               "model.norm.weight": np.ones(D, np.float32)}  # fmt: skip
    p = "model.layers.0."
    for name, shape in (("self_attn.q_proj", (D, D)), ("self_attn.k_proj", (D, D)), ("self_attn.v_proj", (D, D)),
                        ("self_attn.o_proj", (D, D)), ("mlp.gate_proj", (F, D)), ("mlp.up_proj", (F, D)),
                        ("mlp.down_proj", (D, F))):  # fmt: skip
        tensors[p + name + ".weight"] = rng.standard_normal(shape, np.float32)
    tensors[p + "input_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"] = np.ones(
        D, np.float32
    )
    save_file(tensors, str(directory / "model.safetensors"))
    return vocab * D * 4


@pytest.mark.slow
def test_import_peak_host_memory_is_the_model_plus_one_tensor(tmp_path):
    """Peak RSS of an import, less that of importing a 100x smaller model, stays under twice the
    large tensor plus 64 MiB. On CPU the imported parameters themselves live in host memory (one
    copy); the second is the one shard in flight (the mapped file's pages and the shard built
    from them). Reading the whole file and converting it, as a naive import does, needs more."""
    probe = MEMORY_PROBE.format(root=str(pathlib.Path(__file__).resolve().parent.parent))

    def peak(vocab):
        src = tmp_path / f"m{vocab}"
        size = big_embedding_model(src, vocab)
        out = subprocess.run([sys.executable, "-c", probe, str(src), str(tmp_path / f"run{vocab}")],
                             capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu",
                             "PATH": "/usr/bin:/bin"})  # fmt: skip
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1]), size

    small, _ = peak(1024)
    big, size = peak(131072)
    assert size == 256 * 2**20
    print(f"peak RSS: {small / 2**20:.0f} MiB (small model), {big / 2**20:.0f} MiB (256 MiB embedding)")
    assert big - small < 2 * size + 64 * 2**20, (big - small) / size


@pytest.mark.slow
def test_import_and_export_under_two_processes(tmp_path):
    """spmd-launch, 2 processes x 2 devices on fsdp=2,tensor=2: each process builds the shards of
    its own devices; the import computes transformers' logits and the export is bit-exact."""
    from test_multiprocess import env

    def launch(*args):
        cmd = [sys.executable, "-m", "spmd.cli.launch", "--processes", "2", "--host-devices", "2",
               "--", sys.executable, "-m", "spmd.cli.ckpt", *args]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
        assert result.returncode == 0, result.stderr[-3000:]

    mesh = ["--mesh", "fsdp=2,tensor=2", "--rules", "fsdp_tp"]
    launch(
        "import-hf", str(FIXTURES / "mixtral"), "--run-dir", str(tmp_path / "run"), *mesh, "--set", FP32[0]
    )
    ref = np.load(FIXTURES / "mixtral" / "reference.npz")
    setup, params = load(tmp_path / "run", "", "dp", devices=jax.devices()[:1])
    assert_close_to(logits(setup, params, ref["tokens"]), ref["logits"])
    launch("export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "out"), *mesh)
    original, exported = hf_tensors_of(FIXTURES / "mixtral"), hf_tensors_of(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    assert all(np.array_equal(exported[k], v) for k, v in original.items())


@pytest.mark.slow
def test_sample_uses_the_imported_tokenizer(imported):
    """spmd-sample on an imported run encodes the prompt and decodes the greedy tokens with the
    run dir's tokenizer.json (here a word-level one: w<id>)."""
    from tokenizers import Tokenizer

    from spmd.io.inference import Sampler, load

    prompt = "w10 w20 w30"
    cmd = [sys.executable, "-m", "spmd.cli.sample", "--run-dir", str(imported / "llama"),
           "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "5", "--mesh", "fsdp=1",
           "--host-devices", "1"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    new = Sampler(load(str(imported / "llama"), None, "data=8", None, batch=0, decoding=True)).generate(
        [np.array([10, 20, 30], np.int32)], 5, temperature=0.0, top_k=0, seed=0
    )[0]
    tok = Tokenizer.from_file(str(imported / "llama" / "tokenizer.json"))
    assert result.stdout == tok.decode([10, 20, 30, *map(int, new)]) + "\n"


def test_eval_of_an_imported_run_without_data_names_the_data_it_needs(imported):
    """Its tokenizer is not the built-in corpus's bytes: scoring that corpus would be a number of
    nothing, so spmd-eval asks for --data as spmd-train would."""
    cmd = [sys.executable, "-m", "spmd.cli.eval", "--run-dir", str(imported / "llama"), "--mesh", "fsdp=1",
           "--host-devices", "1"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "pass --data DIR prepared with its tokenizer" in result.stderr


def test_written_config_toml_reads_back_as_the_imported_config(imported):
    directory, step = ckpt.locate(str(imported / "mixtral"))
    saved = config_from_json(ckpt.read_meta(directory, step)["run"]["config"])
    again = load_config(str(imported / "mixtral" / "config.toml"))
    assert (again.model, again.train, again.data) == (saved.model, saved.train, saved.data)


@pytest.mark.slow
def test_train_cli_init_from_then_export_keeps_the_hf_family(imported, tmp_path):
    """spmd-train --init-from an imported Qwen2 on another mesh, 2 steps; the run records where
    its parameters came from and carries the tokenizer; its export is a Qwen2 again, with the
    original config's other fields (bos/eos ids) kept."""
    from test_cli import spmd_train

    source = tmp_path / "qwen2"
    shutil.copytree(imported / "qwen2", source)
    shutil.copy2(FIXTURES / "llama" / "tokenizer.json", source / "tokenizer.json")
    result = spmd_train(
        "--init-from", str(source), "--run-dir", str(tmp_path / "ft"), "--steps", "2",
        "--mesh", "fsdp=2,tensor=2", "--rules", "fsdp_tp", "--host-devices", "4",
        "--set", f"data.path={tokens_file(tmp_path)}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "fresh optimizer state" in result.stderr
    config = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert config["init_from"]["hf"]["architecture"] == "Qwen2ForCausalLM"
    assert (tmp_path / "ft" / "tokenizer.json").is_file()
    done = hf.export_hf(str(tmp_path / "ft"), str(tmp_path / "out"))
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert done["architecture"] == "Qwen2ForCausalLM" and done["step"] == 2
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (1, 2)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_import_takes_a_hub_id_from_the_cache_offline(tmp_path):
    """spmd-ckpt import-hf org/name reads huggingface_hub's cache (pre-filled here as the Hub
    lays it out; HF_HUB_OFFLINE=1, so nothing is downloaded); a repository not cached is one
    error line."""
    cache = tmp_path / "hf" / "hub" / "models--acme--tiny-llama"
    shutil.copytree(FIXTURES / "llama", cache / "snapshots" / "0123abcd")
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = spmd_ckpt("import-hf", "acme/tiny-llama", "--run-dir", str(tmp_path / "run"), env=env)
    assert done.returncode == 0, done.stderr
    assert "imported LlamaForCausalLM" in done.stdout and (tmp_path / "run" / "tokenizer.json").is_file()
    missing = spmd_ckpt("import-hf", "acme/absent", "--run-dir", str(tmp_path / "run2"), env=env)
    assert "is not a local directory, nor in the Hugging Face cache" in one_error_line(missing)
