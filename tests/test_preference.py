"""Preference tuning (spmd.training.preference, spmd.data.preference) against TRL's own numbers
(tests/golden/trl_preference.json, made by scripts/parity/trl_preference.py in the torch venv):
the same rows tokenize to TRL's ids, and three SGD steps of each loss give the loss and metrics of
PyTorch autograd of TRL's formulas (TRL's own on the first step: the script's docstring says why
not after);
then sharded layouts and microbatches against one device, LoRA's reference without a copy, and
the errors."""

import json
import pathlib

import jax
import numpy as np
import pytest

from spmd import run
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.data import prepare
from spmd.data.loader import TokenStream
from spmd.data.preference import read_reference
from spmd.io import hf, inference

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "chat" / "llama-chat"
FIXTURES = ROOT / "tests" / "fixtures" / "preference"
GOLDEN = json.loads((ROOT / "tests" / "golden" / "trl_preference.json").read_text())
# TRL's settings -> our keys
CASES = {
    "dpo_sigmoid": ["train.objective=dpo", "preference.loss=sigmoid"],
    "dpo_ipo": ["train.objective=dpo", "preference.loss=ipo"],
    "dpo_hinge": ["train.objective=dpo", "preference.loss=hinge"],
    "dpo_robust": ["train.objective=dpo", "preference.loss=robust", "preference.label_smoothing=0.1"],
    "simpo": ["train.objective=simpo", "preference.gamma=0.5"],
    "orpo": ["train.objective=orpo", "preference.orpo_lambda=0.1"],
}


def prepared(tmp, rows: pathlib.Path, tokenizer: str, val_fraction: float = 0.0, name: str = "data"):
    opts = prepare.Options(
        tokenizer=tokenizer, format="preference", overlong="keep_end", val_fraction=val_fraction
    )
    prepare.prepare([str(rows)], str(tmp / name), opts, progress=False)
    return tmp / name


@pytest.fixture(scope="module")
def trl_setting(tmp_path_factory):
    """The fixture model imported (fp32 compute) and the golden rows prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("preference")
    hf.import_hf(str(MODEL), str(root / "base"), overrides=["model.dtype=float32"])
    return root, prepared(root, FIXTURES / "pairs.jsonl", str(MODEL / "tokenizer.json"))


@pytest.mark.parametrize("rows", ["pairs.jsonl", "conversations.jsonl"])
def test_rows_tokenize_to_trls_ids(trl_setting, rows):
    root, _ = trl_setting
    directory = prepared(root, FIXTURES / rows, str(MODEL / "tokenizer.json"), name=rows)
    manifest = prepare.read_manifest(directory)
    stream = TokenStream(directory, manifest, "train")
    starts = np.concatenate([[0], stream.doc_ends[:-1]])
    want = GOLDEN["tokens"][rows]
    assert manifest["preference"]["pairs"] == {"train": len(want), "val": 0}
    for i, row in enumerate(want):
        for half, completion in enumerate(("chosen_ids", "rejected_ids")):
            lo, hi = starts[2 * i + half], stream.doc_ends[2 * i + half]
            assert stream[lo:hi].tolist() == row["prompt_ids"] + row[completion], (i, completion)
            mask = stream.mask(slice(lo, hi)).tolist()
            assert mask == [0] * len(row["prompt_ids"]) + [1] * len(row[completion])


@pytest.mark.parametrize("case", [*CASES, "dpo_sigmoid+precomputed"])
def test_three_sgd_steps_give_trls_loss_and_metrics(trl_setting, tmp_path, devices, case):
    root, data = trl_setting
    settings = GOLDEN["settings"]
    init = run.init_source(str(root / "base"))
    extra = []
    tie = False  # the first step's reward accuracy, where it counts rounding (below)
    if case.endswith("+precomputed"):  # the reference's log-probabilities written beside the data first
        case, extra = case.removesuffix("+precomputed"), ["preference.reference=precomputed"]
        data = prepared(tmp_path, FIXTURES / "pairs.jsonl", str(MODEL / "tokenizer.json"))
        loaded = inference.load(
            str(root / "base"), None, "fsdp=8", "fsdp", [f"data.path={data}", "train.seq_len=48"]
        )
        inference.write_reference(loaded, str(data))
        # Before the first update the policy is its reference: every reward is zero in exact
        # arithmetic, and the accuracy (chosen reward > rejected) counts the sign of what is left,
        # the last bits by which the written log-probabilities (another program) differ from the
        # step's. The rewards themselves are held to zero below, like every other metric.
        tie = True
    overrides = [
        *CASES[case], *extra, f"data.path={data}", f"preference.beta={settings['beta']}",
        f"train.global_batch_size={settings['pairs_per_step']}", f"train.steps={settings['steps']}",
        "train.seq_len=48", "train.log_every=1", "train.eval_every=0", "optimizer.name=sgd",
        "optimizer.momentum=0", f"optimizer.learning_rate={settings['learning_rate']}",
        "optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1", "optimizer.weight_decay=0",
        "optimizer.grad_clip=0", "checkpoint.async_save=false", "spikes.factor=0",
    ]  # fmt: skip
    setup = assemble(init["config"], "", "fsdp", overrides=overrides, devices=devices[:1])
    run.train(setup, tmp_path / "run", init_from=init)
    ours = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    golden = GOLDEN["cases"][case]
    assert len(ours) == len(golden["exact_steps"]) == settings["steps"]

    def worst(reference):
        diffs = [(abs(mine[k] - v) / max(1.0, abs(v)), step, k)
                 for step, (mine, want) in enumerate(zip(ours, reference)) for k, v in want.items()
                 if not (case == "simpo" and k == "nll_loss")
                 and not (tie and step == 0 and k == "rewards/accuracies")]  # fmt: skip
        return max(diffs)

    # every step equals autograd of TRL's formulas on TRL's tokens (the script's PyTorch run)
    exact = worst(golden["exact_steps"])
    assert exact[0] <= 1e-5, exact
    # DPO's first step (before any update: the same tokens, weights and formulas) equals TRL's own
    if golden["trainer"] == "dpo":
        first = worst(golden["steps"][:1])
        assert first[0] <= 1e-5, first
    print(f"{case}: worst relative difference from the exact run {exact[0]:.1e}")


def test_reference_is_the_same_on_any_layout(trl_setting, tmp_path, devices):
    root, _ = trl_setting
    written = {}
    for mesh, devs in (("", devices[:1]), ("fsdp=8", devices)):
        data = prepared(
            tmp_path, FIXTURES / "pairs.jsonl", str(MODEL / "tokenizer.json"), name=f"on{len(devs)}"
        )
        loaded = inference.load(str(root / "base"), None, mesh, "fsdp", [f"data.path={data}", "train.seq_len=48"],
                                devices=devs)  # fmt: skip
        inference.write_reference(loaded, str(data))
        written[mesh] = read_reference(data, "the pairs")[1]["train"]
    assert written[""].shape == (2 * len(GOLDEN["tokens"]["pairs.jsonl"]),)
    np.testing.assert_allclose(written["fsdp=8"], written[""], rtol=1e-6)


@pytest.fixture(scope="module")
def byte_pairs(tmp_path_factory):
    return prepared(tmp_path_factory.mktemp("bytes"), FIXTURES / "pairs.jsonl", "bytes", val_fraction=0.25)


def losses(cfg, mesh, rules, devices, steps=3):
    setup = assemble(cfg, mesh, rules, devices=devices)
    trainer, batches = setup.trainer, setup.batches()
    state, out = trainer.init_state(), []
    for step in range(steps):
        state, metrics = trainer.train_step(state, batches.train_batch(step))
        out.append([float(metrics["loss"]), float(metrics["aux"]["rewards/margins"])])
    return np.array(out), state


def test_dpo_layouts_and_microbatches_equal_one_device(byte_pairs, devices):
    common = ["train.objective=dpo", f"data.path={byte_pairs}", "train.seq_len=64", "train.global_batch_size=4",
              "optimizer.learning_rate=1e-2", "model.dtype=float32"]  # fmt: skip
    one, state = losses(load_config("tiny", common), "", "fsdp", devices[:1])
    assert one[0, 0] == pytest.approx(np.log(2), abs=1e-6)  # the policy starts as its reference
    assert one[-1, 0] < one[0, 0] and one[-1, 1] > 0
    assert "reference" in state
    many, _ = losses(load_config("tiny", [*common, "train.microbatches=2"]), "data=2,fsdp=2,tensor=2", "fsdp_tp",
                     devices)  # fmt: skip
    np.testing.assert_allclose(many, one, rtol=2e-5, atol=1e-6)
    for mesh, rules in (
        ("context=2,fsdp=2", "cp_ring"),
        ("stage=2,fsdp=2", "pp_fsdp"),
    ):  # ring attention, pipeline
        got, _ = losses(load_config("tiny", common), mesh, rules, devices[:4], steps=2)
        np.testing.assert_allclose(got, one[:2], rtol=2e-5, atol=1e-6, err_msg=mesh)
    moe = ["train.objective=dpo", f"data.path={byte_pairs}", "train.seq_len=64", "train.global_batch_size=4",
           "model.dtype=float32"]  # fmt: skip
    one, _ = losses(load_config("tiny-moe", moe), "", "fsdp", devices[:1], steps=2)
    got, _ = losses(load_config("tiny-moe", moe), "expert=2,fsdp=2", "fsdp_ep", devices[:4], steps=2)
    np.testing.assert_allclose(got, one, rtol=2e-5, atol=1e-6)


def test_lora_dpo_scores_against_the_frozen_base_without_a_copy(byte_pairs, devices):
    cfg = load_config("tiny", ["train.objective=dpo", f"data.path={byte_pairs}", "train.seq_len=64",
                               "train.global_batch_size=4", "lora.rank=4", "optimizer.learning_rate=5e-2"])  # fmt: skip
    got, state = losses(cfg, "fsdp=2", "fsdp", devices[:2])
    assert "reference" not in state  # the reference is the frozen base with the adapters off
    assert got[0, 0] == pytest.approx(np.log(2), abs=1e-6) and got[-1, 0] < got[0, 0]
    setup = assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2])
    full = assemble(load_config("tiny", ["train.objective=dpo", f"data.path={byte_pairs}"]), "fsdp=2", "fsdp",
                    devices=devices[:2])  # fmt: skip
    # LoRA-DPO holds one copy of the base; full DPO two (the policy and its reference)
    assert setup.trainer.state_bytes()["params"] < 0.6 * full.trainer.state_bytes()["params"]


def test_precomputed_reference_must_come_from_the_run_it_starts_from(trl_setting, tmp_path, devices):
    root, _ = trl_setting
    data = prepared(tmp_path, FIXTURES / "pairs.jsonl", str(MODEL / "tokenizer.json"))
    init = run.init_source(str(root / "base"))
    overrides = ["train.objective=dpo", "preference.reference=precomputed", f"data.path={data}", "train.seq_len=48",
                 "train.global_batch_size=4", "train.steps=1", "train.eval_every=0"]  # fmt: skip
    setup = assemble(init["config"], "", "fsdp", overrides=overrides, devices=devices[:1])
    with pytest.raises(UserError, match="write them with spmd-eval --run-dir REFERENCE_RUN"):
        run.train(setup, tmp_path / "run", init_from=init)
    (data / "reference.json").write_text(
        json.dumps({"checkpoint": "/elsewhere/checkpoints/3", "data_key": "x"})
    )
    for split in ("train", "val"):
        np.save(data / f"reference-{split}.npy", np.zeros(16 if split == "train" else 0, np.float32))
    with pytest.raises(UserError, match="written by /elsewhere/checkpoints/3, but this run starts from"):
        run.train(setup, tmp_path / "run", init_from=init)
    assert not (tmp_path / "run").exists()  # nothing written


def test_preference_mistakes_are_errors_naming_the_fix(tmp_path, byte_pairs):
    def prep(rows, **kw):
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        opts = prepare.Options(format="preference", overlong="keep_end", **kw)
        prepare.prepare([str(path)], str(tmp_path / "out"), opts, progress=False, overwrite=True)

    with pytest.raises(UserError, match="line 1: no 'rejected'"):
        prep([{"prompt": "a", "chosen": "b"}])
    with pytest.raises(UserError, match="the same completion"):
        prep([{"prompt": "a", "chosen": "b", "rejected": "b"}])
    with pytest.raises(UserError, match="'chosen' is empty"):
        prep([{"prompt": "a", "chosen": "", "rejected": "b"}])
    with pytest.raises(UserError, match="all strings or all message lists"):
        prep([{"prompt": "a", "chosen": [{"role": "assistant", "content": "x"}], "rejected": "b"}])
    with pytest.raises(UserError, match="preference.beta must be a positive number"):
        load_config("tiny", ["train.objective=dpo", "preference.beta=0"])
    with pytest.raises(UserError, match="train.objective must be one of lm, dpo, simpo, orpo"):
        load_config("tiny", ["train.objective=kto"])
    with pytest.raises(UserError, match="is preference data.*set train.objective"):
        assemble(
            load_config("tiny", [f"data.path={byte_pairs}"]), "", "fsdp", devices=jax.devices()[:1]
        ).batches()
    with pytest.raises(UserError, match="trains on preference pairs.*--format preference"):
        assemble(
            load_config("tiny", ["train.objective=orpo"]), "", "fsdp", devices=jax.devices()[:1]
        ).batches()
    # truncation keeps each sequence's end (the prompt is cut first); drop counts what it drops
    long = [{"prompt": "x" * 40, "chosen": "abc", "rejected": "de"}]
    prep(long, seq_len=16)
    manifest = prepare.read_manifest(tmp_path / "out")
    assert manifest["preference"]["overlong"] == {"policy": "keep_end", "truncated": 1, "dropped": 0}
    assert manifest["splits"]["train"]["tokens"] == 32
    path = tmp_path / "rows.jsonl"
    opts = prepare.Options(format="preference", overlong="drop", seq_len=16)
    with pytest.raises(UserError, match="hold no documents"):
        prepare.prepare([str(path)], str(tmp_path / "dropped"), opts, progress=False)
