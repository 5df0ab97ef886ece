"""Chat data (spmd.data.chat, spmd-data prepare --format chat): conversations rendered and tokenized
exactly as transformers' apply_chat_template does (fixtures made by transformers:
tests/fixtures/make_chat_fixtures.py), assistant-token masks equal to transformers' own, the mask stored
and verified beside the shards, and masked training that counts only trained tokens and equals
the single-device run on every mesh."""

import json
import pathlib

import numpy as np
import pytest
from conftest import run_training

from spmd.assembly.config import load_config
from spmd.core.errors import UserError
from spmd.data import chat, prepare
from spmd.data import tokenizer as tokenizer_lib
from spmd.data.loader import make_batches

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "chat"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())


def load(variant):
    tok = tokenizer_lib.load(str(FIXTURES / variant / "tokenizer.json"))
    return tok, chat.ChatTemplate.load(tok)


@pytest.mark.parametrize("variant", sorted(REFERENCE["variants"]))
def test_rendered_ids_and_assistant_masks_equal_transformers(variant):
    tok, template = load(variant)
    for messages, want in zip(REFERENCE["conversations"], REFERENCE["variants"][variant]):
        assert template.render(messages) == want["text"]
        ids, mask = chat.encode(tok, template, messages, "assistant")
        assert ids.tolist() == want["ids"]
        if "assistant_masks" in want:  # the template marks its assistant text: transformers' mask
            assert mask.tolist() == want["assistant_masks"]
        decoded = tok.decode(ids[mask == 1])
        assistant = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert all(text in decoded for text in assistant) and "user" not in decoded


def test_train_on_all_assistant_last():
    tok, template = load("chatml")
    messages = REFERENCE["conversations"][1]  # two assistant turns
    every = chat.encode(tok, template, messages, "all")[1]
    turns = chat.encode(tok, template, messages, "assistant")[1]
    last = chat.encode(tok, template, messages, "last")[1]
    assert every.all() and 0 < last.sum() < turns.sum() < every.sum()
    assert not (last & ~turns).any()
    assert (
        tok.decode(chat.encode(tok, template, messages, "last")[0][last == 1])
        == "Two: the only even prime.\n"  # <|im_end|> is trained, and decodes to nothing
    )


def test_bad_conversations_and_templates_are_errors(tmp_path):
    tok, template = load("llama3")
    with pytest.raises(UserError, match="message 1 has the unknown role 'bot'; roles are system, user"):
        chat.check_messages(
            [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}], "x", "assistant"
        )
    with pytest.raises(UserError, match=r"no assistant turn to train on \(--train-on assistant\)"):
        chat.check_messages([{"role": "user", "content": "hi"}], "x", "assistant")
    chat.check_messages([{"role": "user", "content": "hi"}], "x", "all")
    with pytest.raises(UserError, match="non-empty list"):
        chat.check_messages("hi", "x", "all")
    plain = tokenizer_lib.load(str(FIXTURES.parent / "hf" / "llama" / "tokenizer.json"))
    with pytest.raises(UserError, match="has no chat_template .*pass --chat-template FILE"):
        chat.ChatTemplate.load(plain)
    (tmp_path / "rewrites.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[earlier]{% else %}"
        "{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    )
    rewrites = chat.ChatTemplate.load(tok, str(tmp_path / "rewrites.jinja"))
    with pytest.raises(UserError, match="renders earlier turns differently .* --train-on all"):
        chat.encode(tok, rewrites, REFERENCE["conversations"][1], "assistant")
    assert chat.encode(tok, rewrites, REFERENCE["conversations"][1], "last")[1].sum() > 0
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(UserError, match="not valid jinja"):
        chat.ChatTemplate.load(tok, str(tmp_path / "broken.jinja")).render([])


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        turns = [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]
        if rng.random() < 0.5:
            turns = [{"role": "system", "content": "Answer in one short sentence."}, *turns]
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (root / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in conversations(400)) + "\n")
    opts = prepare.Options(
        tokenizer=str(FIXTURES / "llama3" / "tokenizer.json"), val_fraction=0.1, format="chat", seq_len=56
    )
    manifest = prepare.prepare([str(root / "chats.jsonl")], str(root / "data"), opts, progress=False)
    return root / "data", manifest


def test_prepare_writes_checked_masks_and_counts(chat_dir, tmp_path):
    directory, manifest = chat_dir
    train = manifest["splits"]["train"]
    masks = np.concatenate([np.fromfile(directory / s["mask"], np.uint8) for s in train["shards"]])
    assert masks.size == train["tokens"] and masks.sum() == train["trained_tokens"] > 0
    assert manifest["chat"]["train_on"] == "assistant" and manifest["chat"]["overlong"]["dropped"] > 0
    kept = train["documents"] + manifest["splits"]["val"]["documents"]
    assert kept + manifest["chat"]["overlong"]["dropped"] == 400
    assert (directory / chat.TEMPLATE_FILE).read_text() == load("llama3")[1].source
    assert prepare.verify(directory, manifest) == []
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(directory, damaged)
    flags = bytearray((damaged / train["shards"][0]["mask"]).read_bytes())
    flags[5] ^= 1
    (damaged / train["shards"][0]["mask"]).write_bytes(bytes(flags))
    with pytest.raises(UserError, match=r"train-00000\.mask does not match the sha256"):
        prepare.verify(damaged, manifest)


def chat_cfg(directory, *extra):
    return load_config(
        "tiny",
        [f"data.path={directory}", "data.packing=segments", "model.vocab_size=512", "train.global_batch_size=8",
         "train.seq_len=32", *extra],
    )  # fmt: skip


def test_the_mask_reaches_the_loss_and_masked_training_equals_one_device(chat_dir, devices):
    directory, _ = chat_dir
    cfg = chat_cfg(directory)
    batches = make_batches(cfg, None)
    windows = batches.global_numpy_batch(0)  # (B, 5, T): inputs, targets, segments, positions, mask
    assert 0 < windows[:, 4].sum() < 0.5 * windows[:, 4].size  # most tokens are prompts
    targets, trained = windows[:, 1], windows[:, 4] == 1
    tok = tokenizer_lib.load(str(directory / "tokenizer.json"))
    assert "<|start_header_id|>" not in tok.decode(targets[trained]) and "=" in tok.decode(targets[trained])

    from spmd.assembly.setup import assemble

    setup = assemble(cfg, "fsdp=1", "fsdp", devices=devices[:1])
    state = setup.trainer.init_state()
    batches = setup.batches()
    _, counted = setup.trainer.eval_step(state["params"], batches.eval_batch(0))
    held_out = np.stack([batches.val[r] for r in range(batches.global_batch_size)])[:, 4]
    assert int(counted) == int(held_out.sum()) < held_out.size // 2  # evaluation counts the mask too
    _, metrics = setup.trainer.train_step(state, batches.train_batch(0))
    assert int(metrics["tokens"]) == int(trained.sum())

    one, _, _ = run_training(cfg, "fsdp=1", "fsdp", 6, devices=devices[:1])
    for mesh, rules, n in (("fsdp=4", "fsdp", 4), ("data=2,fsdp=2,tensor=2", "fsdp_tp", 8)):
        losses, _, _ = run_training(cfg, mesh, rules, 6, devices=devices[:n])
        np.testing.assert_allclose(losses, one, rtol=1e-5)


def test_chat_data_needs_segments_packing(chat_dir):
    with pytest.raises(
        UserError, match="chat data with a loss mask, which only data.packing = segments applies"
    ):
        make_batches(chat_cfg(chat_dir[0], "data.packing=concat"), None)


def test_overlong_split_keeps_and_counts(tmp_path):
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in conversations(40)) + "\n")
    opts = prepare.Options(
        tokenizer=str(FIXTURES / "llama3" / "tokenizer.json"), format="chat", seq_len=56, overlong="split"
    )
    manifest = prepare.prepare([str(tmp_path / "chats.jsonl")], str(tmp_path / "data"), opts, progress=False)
    over = manifest["chat"]["overlong"]
    assert over["dropped"] == 0 and 0 < over["split"] < 40 and manifest["documents"] == 40


def test_cli_chat_errors_are_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    (tmp_path / "prompt.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    llama3 = str(FIXTURES / "llama3" / "tokenizer.json")
    plain = str(FIXTURES.parent / "hf" / "llama" / "tokenizer.json")
    cases = {
        ("bad.jsonl", llama3): "line 1: message 0 has the unknown role 'bot'",
        ("prompt.jsonl", llama3): "no assistant turn to train on",
        ("prompt.jsonl", plain): "has no chat_template",
    }
    for (data, tok), message in cases.items():
        done = subprocess.run(
            [sys.executable, "-m", "spmd.cli.data", "prepare", str(tmp_path / data), "--format", "chat", "--tokenizer", tok,
             "--out", str(tmp_path / "out"), "--quiet"],
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 2 and done.stderr.startswith("error: ") and message in done.stderr
        assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
