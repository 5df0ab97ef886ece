"""LoRA (spmd.transforms.lora): adapters sharded like the weights they adapt, a frozen base, sharded runs equal
to one device, adapter-only checkpoints that resume onto their base, the merged model for
sampling, evaluation and export, and a peft adapter directory that peft loads with equal logits."""

import json
import os
import pathlib
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmd import run
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.io import checkpoint as ckpt
from spmd.io import hf, inference
from spmd.parallel.sharding import path_str
from spmd.transforms import lora

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"
CHAT_MODEL = ROOT / "tests" / "fixtures" / "chat" / "llama-chat"
LORA = ["lora.rank=4", "lora.alpha=8", "optimizer.learning_rate=1e-2"]
OVERRIDES = ["train.log_every=1", "train.eval_every=0", "checkpoint.async_save=false"]


def test_adapters_are_split_like_their_weights_and_only_they_train(devices):
    setup = assemble("tiny", "fsdp=2,tensor=2", "fsdp_tp", overrides=LORA, devices=devices[:4])
    state = setup.trainer.abstract_state
    attn, mlp = state["params"]["layers"]["attn"], state["params"]["layers"]["mlp"]
    # A takes the adapted weight's input axes (embed: fsdp), B its output axes; the rank axis whole.
    assert attn["lora_wq_DNH"]["a"].sharding.spec == P(None, "fsdp", None)
    assert attn["lora_wq_DNH"]["b"].sharding.spec == P(None, None, "tensor", None)
    assert attn["lora_wo_NHD"]["a"].sharding.spec == P(None, "tensor", None, None)
    assert mlp["lora_w_down_FD"]["b"].sharding.spec == P(None, None, "fsdp")
    assert attn["lora_wq_DNH"]["a"].shape == (2, 64, 4)
    # Only the adapters are trained: the base is a separate, frozen part of the state.
    assert not any("lora_" in path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state["frozen"]))
    assert all("lora_" in path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(state["params"]))
    bytes_ = setup.trainer.state_bytes()
    full = assemble("tiny", "fsdp=2,tensor=2", "fsdp_tp", devices=devices[:4]).trainer.state_bytes()
    assert bytes_["gradients"] < full["gradients"] / 5
    assert bytes_["optimizer_state"] < full["optimizer_state"] / 5
    assert bytes_["params"] == full["params"] + bytes_["gradients"]  # the base, plus the adapters
    half = assemble("tiny", "fsdp=2,tensor=2", "fsdp_tp", overrides=[*LORA, "lora.base_dtype=bfloat16"],
                    devices=devices[:4]).trainer.state_bytes()  # fmt: skip
    assert half["frozen_params"] == full["params"] // 2


def train(cfg, mesh, rules, steps, devices):
    setup = assemble(cfg, mesh, rules, devices=devices)
    trainer, batches = setup.trainer, setup.batches()
    state = trainer.init_state()
    base = jax.tree.map(np.asarray, state["frozen"])
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, base


def test_sharded_lora_equals_one_device_and_leaves_the_base_alone(devices):
    cfg = load_config("tiny", [*LORA, "train.global_batch_size=8"])
    one, state, base = train(cfg, "", "fsdp", 3, devices[:1])
    assert one[-1] < one[0]
    for leaf, before in zip(jax.tree.leaves(state["frozen"]), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), before)
    many, _, _ = train(load_config("tiny", [*LORA, "train.global_batch_size=8", "train.microbatches=2"]),
                       "fsdp=2,tensor=2", "fsdp_tp", 3, devices[:4])  # fmt: skip
    np.testing.assert_allclose(many, one, rtol=2e-5)
    dropped, _, _ = train(load_config("tiny", [*LORA, "train.global_batch_size=8", "lora.dropout=0.5"]),
                          "", "fsdp", 3, devices[:1])  # fmt: skip
    assert dropped[0] == one[0] and dropped[-1] != one[-1]  # B = 0 at step 0: dropout cannot show yet


def test_the_adapted_model_equals_its_merged_weights():
    setup = assemble("tiny", "", "fsdp", overrides=[*LORA, "model.dtype=float32"], devices=jax.devices()[:1])
    state = setup.trainer.init_state()
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: x + rng.normal(0, 0.1, x.shape).astype(x.dtype), state["params"])
    params = lora.combine(adapters, state["frozen"])
    tokens = rng.integers(0, 256, (2, 16))
    adapted = nnx.merge(setup.plan.graphdef, params)(tokens)
    plain = assemble("tiny", "", "fsdp", overrides=["model.dtype=float32"], devices=jax.devices()[:1])
    merged = nnx.merge(plain.plan.graphdef, lora.merged(params, setup.cfg.lora.scale))(tokens)
    base = nnx.merge(plain.plan.graphdef, state["frozen"])(tokens)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(base) - np.asarray(adapted)).max() > 1e-2  # the adapters do something


def test_bad_lora_settings_are_errors_naming_the_fix():
    with pytest.raises(
        UserError, match="lora.targets: gpt2 has no projection 'gate'.*targets are q, k, v, o, up, down"
    ):
        assemble(
            "tiny-gpt2",
            "",
            "fsdp",
            overrides=["lora.rank=2", "lora.targets=q,gate"],
            optimizer=False,
            devices=jax.devices()[:1],
        )
    with pytest.raises(UserError, match=r"lora.rank \(100\) is larger than wq_DNH \(64 x 64\).*<= 64"):
        assemble("tiny", "", "fsdp", overrides=["lora.rank=100"], optimizer=False, devices=jax.devices()[:1])
    with pytest.raises(UserError, match="lora.dropout must be in"):
        load_config("tiny", ["lora.rank=2", "lora.dropout=1.5"])
    with pytest.raises(UserError, match="lora.base_dtype must be"):
        load_config("tiny", ["lora.base_dtype=int8"])


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """The chat fixture (a Llama saved by transformers) imported, fp32 compute."""
    root = tmp_path_factory.mktemp("lora")
    hf.import_hf(str(CHAT_MODEL), str(root / "base"), overrides=["model.dtype=float32"])
    return root / "base"


def test_adapter_checkpoints_resume_onto_their_base_and_export_for_peft(base_run, tmp_path, devices):
    init = run.init_source(str(base_run))
    cfg = init["config"]
    overrides = [*OVERRIDES, *LORA, "checkpoint.every=2", "train.seq_len=32", "train.global_batch_size=8"]
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 398, 20_000).astype(np.uint16))
    overrides.append(f"data.path={tokens}")

    def setup(steps):
        return assemble(
            cfg, "fsdp=4", "fsdp", overrides=[*overrides, f"train.steps={steps}"], devices=devices[:4]
        )

    straight = run.train(setup(4), tmp_path / "straight", init_from=init)
    first = run.train(setup(2), tmp_path / "lora", init_from=init)
    second = run.train(
        setup(4), tmp_path / "lora"
    )  # resumes: adapters from its checkpoint, the base from runs/base
    assert [r["loss"] for r in first.metrics + second.metrics] == [r["loss"] for r in straight.metrics]
    saved = ckpt.saved_arrays(*ckpt.locate(str(tmp_path / "lora")))
    assert {k.split("/")[0] for k in saved} == {"params", "opt_state", "step"}
    assert all("lora_" in k for k in saved if k.startswith("params/"))  # adapters only

    # Sampling and evaluation load the merged model: base + scale A B.
    loaded = inference.load(str(tmp_path / "lora"), None, "fsdp=8", None, batch=0)
    assert not loaded.cfg.lora.enabled
    base = inference.load(str(base_run), None, "fsdp=8", None, batch=0)
    q = "layers/attn/wq_DNH"
    merged_q = np.asarray(loaded.params["layers"]["attn"]["wq_DNH"])
    assert np.abs(merged_q - np.asarray(base.params["layers"]["attn"]["wq_DNH"])).max() > 0, q
    tokens_BT = np.random.default_rng(1).integers(0, 398, (2, 24))
    ours = np.asarray(nnx.merge(loaded.plan.graphdef, loaded.params)(tokens_BT))

    merged_dir = tmp_path / "hf" / "merged"
    hf.export_hf(str(tmp_path / "lora"), str(merged_dir), merge=True)
    assert (merged_dir / "model.safetensors").is_file()
    with pytest.raises(UserError, match="has no model transform to merge"):
        hf.export_hf(str(base_run), str(tmp_path / "hf" / "x"), merge=True)
    adapter_dir = tmp_path / "hf" / "adapter"
    done = lora.export_adapter(str(tmp_path / "lora"), str(adapter_dir))
    assert done["modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    with pytest.raises(UserError, match="holds no LoRA adapters"):
        lora.export_adapter(str(base_run), str(tmp_path / "hf" / "y"))
    has_peft = (
        TORCH_PYTHON.exists() and not subprocess.run([str(TORCH_PYTHON), "-c", "import peft"]).returncode
    )
    if not has_peft:
        pytest.skip("needs .venv-torch (Python 3.11 with torch, transformers, peft) for peft's side")
    np.save(tmp_path / "tokens_BT.npy", tokens_BT)
    done = subprocess.run(
        [str(TORCH_PYTHON), str(ROOT / "scripts" / "parity" / "peft_side.py"), str(CHAT_MODEL), str(adapter_dir),
         str(tmp_path / "tokens_BT.npy"), str(tmp_path / "peft.npy")],
        capture_output=True, text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = np.load(tmp_path / "peft.npy")
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_a_lora_run_is_pinned_to_its_base(base_run, tmp_path, devices):
    """A base replaced at the same path is an error naming both digests, never silently used; a run
    drawn from its seed keeps that seed's base when resumed with another --seed."""
    import shutil

    from spmd import start as start_lib

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    init = run.init_source(str(base))
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 398, 4_000).astype(np.uint16))
    overrides = [*OVERRIDES, *LORA, "train.seq_len=16", "train.global_batch_size=4", f"data.path={tokens}",
                 "train.steps=1"]  # fmt: skip
    setup = assemble(init["config"], "", "fsdp", overrides=overrides, devices=devices[:1])
    run.train(setup, tmp_path / "lora", init_from=init)
    # the base replaced by other weights of the same shapes, at the same path (import-hf --overwrite)
    from safetensors.numpy import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(CHAT_MODEL, other)
    tensors = load_file(other / "model.safetensors")
    save_file(
        {k: v * 1.01 for k, v in tensors.items()}, other / "model.safetensors", metadata={"format": "pt"}
    )
    hf.import_hf(str(other), str(base), overrides=["model.dtype=float32"], overwrite=True)
    with pytest.raises(UserError, match=r"was trained on the weights of .* with digest [0-9a-f]{16}, but the "
                                        r"checkpoint there now holds others \(digest [0-9a-f]{16}\)"):  # fmt: skip
        inference.load(str(tmp_path / "lora"), None, "fsdp=8", "fsdp", batch=0)

    cfg = load_config(
        "tiny", [*LORA, "train.seq_len=16", "train.global_batch_size=4", "train.steps=1", *OVERRIDES]
    )
    first = assemble(cfg, "", "fsdp", devices=devices[:1])
    run.train(first, tmp_path / "seeded")
    run.train(assemble(cfg, "", "fsdp", overrides=["train.seed=7", "train.steps=2"], devices=devices[:1]),
              tmp_path / "seeded")  # resumed under another seed: its checkpoint's config says 7  # fmt: skip
    again = assemble(cfg, "", "fsdp", overrides=["train.seed=9", "train.steps=3"], devices=devices[:1])
    started = start_lib.resume_or_init(again.trainer, again.batches(), tmp_path / "seeded")
    pinned = again.trainer.frozen_from(again.trainer.fresh_weights(0))  # the seed the run started with
    for leaf, want in zip(jax.tree.leaves(started.state["frozen"]), jax.tree.leaves(pinned), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))
    other = again.trainer.frozen_from(again.trainer.fresh_weights(7))
    assert np.abs(np.asarray(jax.tree.leaves(other)[0]) - np.asarray(jax.tree.leaves(pinned)[0])).max() > 0.1
