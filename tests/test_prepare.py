"""Real text in: tokenizers trained here (BPE with `tokenizers`, SentencePiece), `spmd-data prepare`
over .txt/.jsonl/.parquet, the manifest and its checks, bad input, and a packed run that samples text."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from spmd.core.errors import UserError
from spmd.data import prepare, tokenizer

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nprint(os.getcwd())\n",
    "naïve café — unicode text ✓\n",
    "class Point:\n    x: int\n    y: int\n" * 2,
    "short",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The documents as .txt files, one .jsonl and one .parquet; a BPE tokenizer.json and a
    SentencePiece model trained on them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece

    root = tmp_path_factory.mktemp("corpus")
    txt = root / "txt"
    txt.mkdir()
    for i, doc in enumerate(DOCS):
        (txt / f"doc{i}.txt").write_text(doc)
    (root / "docs.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    )
    pq.write_table(pa.table({"content": DOCS}), root / "docs.parquet")

    # spmd-data train-tokenizer's BPE: <|endoftext|> is id 0
    trained = prepare.train_tokenizer([str(txt)], str(root / "tokenizer.json"), 300, prepare.Options())
    assert trained["documents"] == len(DOCS) and trained["vocab_size"] <= 300
    (root / "sp.txt").write_text("\n".join(DOCS * 20))
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "sp.txt"), model_prefix=str(root / "sp"), vocab_size=60, model_type="bpe",
        character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    return root


def _tokens(out: pathlib.Path) -> list[np.ndarray]:
    """Every document of a prepared directory (train and val, in order), as arrays."""
    m = prepare.read_manifest(out)
    docs = []
    for split in ("train", "val"):
        for shard in (s for s in m["splits"][split]["shards"] if s["documents"]):
            tokens = np.fromfile(out / shard["bin"], dtype=m["dtype"])
            ends = np.fromfile(out / shard["idx"], dtype=np.int64)
            docs += np.split(tokens, ends[:-1])
    return docs


def test_tokenizers_round_trip(corpus):
    bpe = tokenizer.load(str(corpus / "tokenizer.json"))
    sp = tokenizer.load(str(corpus / "sp.model"))
    assert isinstance(bpe, tokenizer.HFTokenizer) and isinstance(sp, tokenizer.SentencePieceTokenizer)
    assert bpe.vocab_size == 300 and bpe.eos_id == 0 and sp.vocab_size == 60 and sp.eos_id == 2
    for tok in (bpe, sp, tokenizer.ByteTokenizer()):
        for doc in DOCS:
            ids = tok.encode(doc)
            assert ids.max() < tok.vocab_size
            assert tok.decode(ids).strip() == doc.strip() or isinstance(tok, tokenizer.SentencePieceTokenizer)
    assert sp.decode(sp.encode("class Point:")) == "class Point:"
    with pytest.raises(UserError, match="not a loadable SentencePiece model"):
        tokenizer.load(str(corpus / "txt" / "doc0.txt"))
    with pytest.raises(UserError, match="not a loadable tokenizer.json"):
        tokenizer.load(str(_write(corpus / "bad.json", "{not json")))


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_prepare_gives_the_tokens_of_encoding_each_document(corpus, tmp_path, kind):
    inputs = {"txt": corpus / "txt", "jsonl": corpus / "docs.jsonl", "parquet": corpus / "docs.parquet"}[kind]
    opts = prepare.Options(
        tokenizer=str(corpus / "tokenizer.json"), text_field="content" if kind == "parquet" else "text"
    )
    m = prepare.prepare([str(inputs)], str(tmp_path / "out"), opts, progress=False)
    bpe = tokenizer.load(str(corpus / "tokenizer.json"))
    want = [np.append(bpe.encode(d), bpe.eos_id) for d in DOCS]
    assert [d.tolist() for d in _tokens(tmp_path / "out")] == [w.tolist() for w in want]
    assert m["documents"] == len(DOCS) and m["tokens"] == sum(map(len, want)) and m["dtype"] == "uint16"
    assert m["tokenizer"]["sha256"] == bpe.sha256 and (tmp_path / "out" / "tokenizer.json").is_file()
    # Each split counts its text's UTF-8 bytes: bits per byte for any tokenizer.
    assert sum(s["bytes"] for s in m["splits"].values()) == sum(len(d.encode()) for d in DOCS)


def test_prepare_splits_by_content_is_idempotent_and_uses_workers(corpus, tmp_path):
    opts = prepare.Options(tokenizer=str(corpus / "sp.model"), val_fraction=0.4)
    out = tmp_path / "out"
    m = prepare.prepare([str(corpus / "txt")], str(out), opts, workers=2, progress=False)
    held_out = [d for d in DOCS if prepare.in_val(d, 0.4)]
    assert 0 < m["splits"]["val"]["documents"] == len(held_out) < len(DOCS)
    one = prepare.prepare([str(corpus / "txt")], str(tmp_path / "one"), opts, workers=1, progress=False)
    assert [d.tolist() for d in _tokens(out)] == [d.tolist() for d in _tokens(tmp_path / "one")]
    assert one["key"] == m["key"]
    stamp = (out / "manifest.json").stat().st_mtime_ns
    again = prepare.prepare([str(corpus / "txt")], str(out), opts, workers=2, progress=False)
    assert again.get("unchanged") and (out / "manifest.json").stat().st_mtime_ns == stamp
    with pytest.raises(UserError, match="already holds a different prepared dataset; pass --overwrite"):
        prepare.prepare([str(corpus / "docs.jsonl")], str(out), opts, progress=False)
    (out / "train-00000.bin").write_bytes((out / "train-00000.bin").read_bytes()[:-2])  # truncated
    with pytest.raises(UserError, match="train-00000.bin is .* bytes but the manifest says"):
        prepare.read_manifest(out)


def test_bad_input_names_the_file_and_line(corpus, tmp_path):
    opts = prepare.Options()
    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": "ok", \n')
    cases = [
        ([str(bad)], "bad.jsonl line 2 is not JSON"),
        ([str(_write(tmp_path / "nofield.jsonl", '{"body": "x"}\n'))], "nofield.jsonl line 1 has no text field 'text'"),
        ([str(tmp_path / "missing.txt")], "input '.*missing.txt' not found"),
        ([str(_write(tmp_path / "other" / "x.csv", "a,b").parent)], "holds no .txt, .md, .jsonl, .parquet files; name other suffixes with --ext"),
    ]  # fmt: skip
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    cases.append(
        ([str(latin)], "latin.txt is not UTF-8 text .byte 3.; fix the file, or pass --errors replace")
    )
    for inputs, message in cases:
        with pytest.raises(UserError, match=message):
            prepare.prepare(inputs, str(tmp_path / "out"), opts, progress=False)
        assert not (tmp_path / "out").exists()  # nothing written
    m = prepare.prepare(
        [str(latin)], str(tmp_path / "out"), prepare.Options(errors="replace"), progress=False
    )
    assert m["documents"] == 1
    # a file named on its own is a document whatever its name; directories take --ext's suffixes
    licence = _write(tmp_path / "src" / "GPL-3", "GNU GENERAL PUBLIC LICENSE\n")
    _write(tmp_path / "src" / "notes.rst", "notes\n")
    assert prepare.prepare([str(licence)], str(tmp_path / "named"), opts, progress=False)["documents"] == 1
    m = prepare.prepare(
        [str(tmp_path / "src")], str(tmp_path / "rst"), opts, progress=False, extensions=(".rst",)
    )
    assert m["documents"] == 1 and m["inputs"] == [str(tmp_path / "src" / "notes.rst")]
    with pytest.raises(UserError, match="tokenizer '.*nope.json' not found"):
        prepare.prepare(
            [str(latin)], str(tmp_path / "o2"), prepare.Options(tokenizer=str(tmp_path / "nope.json"))
        )


def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "spmd.cli.data", "prepare", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert (
        result.returncode == 2
        and result.stderr.startswith("error: input ")
        and result.stderr.count("\n") == 1
    )
    assert not (tmp_path / "o").exists()


def test_mixture_proportions_follow_the_weights():
    from spmd.data.loader import mixture_order

    weights, n = [3.0, 1.0, 0.5], 10_000
    order = mixture_order(weights)
    tags = np.array([order[i] for i in range(n)])
    for k, w in enumerate(weights):
        p = w / sum(weights)
        assert abs((tags == k).sum() - n * p) <= 3 * np.sqrt(n * p * (1 - p)), (k, (tags == k).sum())
    assert [order[i] for i in range(5000, 5010)] == tags[5000:5010].tolist()  # a pure function of i


def test_held_out_bits_per_byte_of_tokenized_data(corpus, tmp_path, tiny_cfg):
    """spmd-eval's bits per byte: nats per token over ln 2 and the held-out text's bytes per token
    (the prepared manifest's count); 1 byte per token on byte-level data."""
    from spmd.assembly.config import apply_overrides
    from spmd.data.loader import make_batches

    data = _prepared(corpus, tmp_path, "bpe", [d * 4 for d in DOCS] * 8)
    held_out = prepare.read_manifest(data)["splits"]["val"]
    cfg = apply_overrides(tiny_cfg, [f"data.path={data}", "train.seq_len=16", "model.vocab_size=512"])
    batches = make_batches(cfg, None)
    assert batches.val_bytes_per_token == held_out["bytes"] / held_out["tokens"] > 1.5
    assert make_batches(tiny_cfg, None).val_bytes_per_token == 1.0  # the embedded corpus: bytes


def _prepared(corpus, tmp_path, name, docs):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}: {d}"}) + "\n" for i, d in enumerate(docs)))
    opts = prepare.Options(tokenizer=str(corpus / "tokenizer.json"), val_fraction=0.2)
    prepare.prepare([str(path)], str(tmp_path / name), opts, progress=False)
    return tmp_path / name


def test_a_mixture_resumes_and_changes_batch_size_on_the_same_sample_stream(corpus, tmp_path, tiny_cfg):
    """The batches of a 2-source packed mixture are a pure function of the sample index: a resumed
    run (fresh Batches moved to the data position) draws what the uninterrupted one draws, also
    with another global batch size."""
    from spmd.assembly.config import apply_overrides
    from spmd.data.loader import make_batches

    a = _prepared(corpus, tmp_path, "code", [d * 4 for d in DOCS[::2]] * 8)
    b = _prepared(corpus, tmp_path, "prose", [d * 4 for d in DOCS[1::2]] * 8)
    sources = json.dumps([{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1, "name": "en"}])
    cfg = apply_overrides(tiny_cfg, [f"data.sources={sources}", "data.packing=segments", "train.seq_len=16",
                                     "train.global_batch_size=4", "model.vocab_size=320"])  # fmt: skip
    whole = make_batches(cfg, None)
    assert list(whole.val_sources) == ["code", "en"] and "mixture of code (weight 3)" in whole.description
    stream = np.concatenate([whole.global_numpy_batch(s) for s in range(6)])  # 24 samples
    resumed = make_batches(cfg, None)
    resumed.resume_at(3, whole.consumed_samples(3))
    np.testing.assert_array_equal(
        np.concatenate([resumed.global_numpy_batch(s) for s in (3, 4, 5)]), stream[12:]
    )
    bigger = make_batches(apply_overrides(cfg, ["train.global_batch_size=6"]), None)
    bigger.resume_at(2, 8)  # 8 samples consumed at batch 4, now batches of 6
    np.testing.assert_array_equal(
        np.concatenate([bigger.global_numpy_batch(s) for s in (2, 3)]), stream[8:20]
    )
    bad = json.dumps([{"path": str(a)}, {"path": str(tmp_path / "nowhere")}])
    with pytest.raises(UserError, match="data.sources 'nowhere': .* not found"):
        make_batches(apply_overrides(cfg, [f"data.sources={bad}"]), None)
    with pytest.raises(UserError, match="weight must be a positive number"):
        apply_overrides(cfg, [f'data.sources=[{{"path": "{a}", "weight": 0}}]'])
    with pytest.raises(UserError, match="raise model.vocab_size to at least 300"):
        make_batches(apply_overrides(cfg, ["model.vocab_size=256"]), None)
    from spmd.data.loader import data_tokenizer

    assert data_tokenizer(cfg.data).sha256 == tokenizer.file_hash(corpus / "tokenizer.json")
    with pytest.raises(UserError, match="is not the tokenizer .* was prepared with"):
        data_tokenizer(apply_overrides(cfg, [f"data.tokenizer={corpus / 'sp.model'}"]).data)
    sp_source = prepare.prepare(
        [str(corpus / "txt")],
        str(tmp_path / "sp"),
        prepare.Options(tokenizer=str(corpus / "sp.model"), val_fraction=0.3),
        progress=False,
    )
    assert sp_source["tokenizer"]["vocab_size"] == 60
    mixed = json.dumps([{"path": str(a)}, {"path": str(tmp_path / "sp")}])
    with pytest.raises(UserError, match="every source of a mixture needs the same tokenizer"):
        data_tokenizer(apply_overrides(cfg, [f"data.sources={mixed}"]).data)


@pytest.mark.slow
def test_prepare_train_a_packed_mixture_resume_and_sample_text(corpus, tmp_path):
    """spmd-data prepare (the console command) makes two sources; spmd-train trains a packed
    2-source mixture on the BPE tokenizer; killed (-9) mid-run and rerun, it ends with the losses
    of the uninterrupted run; eval_loss per source; spmd-sample prints text through the run
    dir's copy of the tokenizer."""
    from test_cli import ROOT, spmd_train

    paths = []
    for name, docs in (("code", DOCS[::2]), ("prose", DOCS[1::2])):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": f"{i}: {d * 3}"}) + "\n" for i, d in enumerate(docs * 12)))
        prep = subprocess.run(
            [sys.executable, "-m", "spmd.cli.data", "prepare", str(src), "--tokenizer", str(corpus / "tokenizer.json"),
             "--out", str(tmp_path / name), "--val-fraction", "0.2", "--quiet"], capture_output=True, text=True,
        )  # fmt: skip
        assert prep.returncode == 0 and "training documents" in prep.stderr, prep.stderr
        paths.append(str(tmp_path / name))
    sources = json.dumps([{"path": paths[0], "weight": 2}, {"path": paths[1], "name": "en"}])
    base = ["--config", "tiny", "--mesh", "fsdp=2", "--host-devices", "2", "--set", f"data.sources={sources}",
            "--set", "data.packing=segments", "--set", "train.seq_len=32", "--set", "optimizer.schedule_steps=6",
            "--log-every", "1", "--eval-every", "3"]  # fmt: skip
    base += ["--set", "model.vocab_size=320"]
    whole = spmd_train(*base, "--steps", "6", "--run-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "mixture of code (weight 2)" in whole.stderr and "packing: segments" in whole.stderr
    # The same command under tests/hang_train.py, which kills it (-9) before step 5; run again, it
    # resumes from step 3 (saved synchronously, so surely committed) to the same losses.
    killed = [sys.executable, str(ROOT / "tests" / "hang_train.py"), *base, "--steps", "6", "--checkpoint-every",
              "3", "--set", "checkpoint.async_save=false", "--run-dir", str(tmp_path / "resumed")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env |= {"DIE_STEP": "4", "DIE_PROCESS": "0", "HANG_MARK": str(tmp_path / "mark")}
    first = subprocess.run(killed, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == -9, first.stderr[-2000:]
    again = subprocess.run(killed, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints'}/3" in again.stderr
    runs = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("whole", "resumed")
    }
    assert [r["loss"] for r in runs["resumed"]] == [r["loss"] for r in runs["whole"]]  # bit-exact
    last = runs["whole"][-1]
    assert last["step"] == 6 and {"eval_loss", "eval_loss/code", "eval_loss/en"} <= set(last)
    run_dir = tmp_path / "whole"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["tokenizer"]["sha256"] == tokenizer.file_hash(corpus / "tokenizer.json")
    assert (run_dir / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()
    sample = subprocess.run(
        [sys.executable, "-m", "spmd.cli.sample", "--run-dir", str(run_dir), "--prompt", "def add",
         "--max-new-tokens", "8", "--temperature", "0"], capture_output=True, text=True,
    )  # fmt: skip
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("def add") and len(sample.stdout) > len("def add")


def test_train_tokenizer_command(corpus, tmp_path):
    """spmd-data train-tokenizer: one line on stderr, a tokenizer whose EOS is id 0, which
    prepare takes; bad input is one error line."""

    def spmd_data(*args):
        return subprocess.run([sys.executable, "-m", "spmd.cli.data", *args], capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip

    out = tmp_path / "tok" / "tokenizer.json"
    done = spmd_data("train-tokenizer", str(corpus / "docs.jsonl"), "--vocab-size", "280", "--out", str(out))
    assert done.returncode == 0 and done.stderr.startswith(f"wrote {out}: "), done.stderr
    tok = tokenizer.load(str(out))
    assert tok.eos_id == 0 and tok.vocab_size <= 280
    bad = spmd_data("train-tokenizer", str(corpus / "docs.jsonl"), "--vocab-size", "100", "--out", str(out))
    assert bad.returncode == 2 and bad.stderr.startswith("error: --vocab-size must be at least 257")


def test_data_without_held_out_documents_trains_without_evaluation(corpus, tmp_path, tiny_cfg):
    """Prepared data may hold out nothing: spmd-data says so (a warning line), training with
    evaluation off takes it, and with evaluation on it is an error naming both ways out."""
    from spmd.assembly.config import apply_overrides
    from spmd.data.loader import make_batches

    opts = prepare.Options(tokenizer=str(corpus / "tokenizer.json"), val_fraction=0.0)
    prepare.prepare([str(corpus / "docs.jsonl")] * 1, str(tmp_path / "all"), opts, progress=False)
    cfg = apply_overrides(
        tiny_cfg, [f"data.path={tmp_path / 'all'}", "train.seq_len=8", "model.vocab_size=512"]
    )
    with pytest.raises(UserError, match="no held-out documents, which evaluation needs.*--eval-every 0"):
        make_batches(cfg, None)
    batches = make_batches(apply_overrides(cfg, ["train.eval_every=0"]), None)
    assert batches.n_train_windows > 0 and batches.n_val_windows == 0


def test_a_checkpoint_meets_data_of_another_tokenizer_only_when_asked(corpus, tmp_path, tiny_cfg, devices):
    """A run trained on BPE data, resumed on bytes (data.path dropped), started from with
    --init-from, or evaluated on bytes data: each an error naming both tokenizers, unless the swap
    is asked for. Raw token ids (.npy) say nothing of their tokenizer and pass, and the run keeps
    the tokenizer it started from."""

    from spmd import run
    from spmd.assembly.config import apply_overrides
    from spmd.assembly.setup import assemble

    bpe = _prepared(corpus, tmp_path, "bpe", [d * 4 for d in DOCS] * 8)
    common = ["train.seq_len=16", "model.vocab_size=512", "train.eval_every=0", "train.log_every=2",
              "checkpoint.async_save=false"]  # fmt: skip
    cfg = apply_overrides(tiny_cfg, [*common, f"data.path={bpe}", "train.steps=2"])
    run.train(assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "run")

    on_bytes = apply_overrides(tiny_cfg, [*common, "train.steps=4"])
    setup = assemble(on_bytes, "fsdp=2", "fsdp", devices=devices[:2])
    with pytest.raises(
        UserError, match=r"was trained with the tokenizer .*tokenizer.json .*the data's is bytes"
    ):
        run.train(setup, tmp_path / "run")
    with pytest.raises(UserError, match="--allow-tokenizer-change"):
        run.train(setup, tmp_path / "fine-tune", init_from=str(tmp_path / "run"))

    np.save(tmp_path / "ids.npy", np.arange(4000, dtype=np.uint16) % 300)
    raw = apply_overrides(tiny_cfg, [*common, f"data.path={tmp_path / 'ids.npy'}", "train.steps=2"])
    done = run.train(
        assemble(raw, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "ft", init_from=str(tmp_path / "run")
    )
    assert done.step == 2
    kept = json.loads((tmp_path / "ft" / "config.json").read_text())["tokenizer"]
    assert kept == json.loads((tmp_path / "run" / "config.json").read_text())["tokenizer"]

    bytes_data = tmp_path / "bytes"
    prepare.prepare(
        [str(corpus / "txt")] * 1, str(bytes_data), prepare.Options(val_fraction=0.5), progress=False
    )
    evaluate = [sys.executable, "-m", "spmd.cli.eval", "--run-dir", str(tmp_path / "ft"), "--data",
                str(bytes_data), "--host-devices", "1", "--mesh", "fsdp=1", "--batches", "1"]  # fmt: skip
    refused = subprocess.run(evaluate, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert refused.returncode == 2 and "the data's is bytes" in refused.stderr, refused.stderr
    allowed = subprocess.run([*evaluate, "--allow-tokenizer-change"], capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL)  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert run.train(setup, tmp_path / "run", allow_tokenizer_change=True).step == 4


def test_prepared_shards_are_verified_like_checkpoints(corpus, tmp_path, tiny_cfg):
    """The manifest holds each shard's sha256: a flipped byte in a .bin or .idx is an error when
    the data is opened and under `spmd-data verify`; a directory of shards without its manifest is
    refused rather than read as text."""
    from spmd.assembly.config import apply_overrides
    from spmd.data.loader import make_batches

    data = _prepared(corpus, tmp_path, "bpe", [d * 4 for d in DOCS] * 8)
    cfg = apply_overrides(tiny_cfg, [f"data.path={data}", "train.seq_len=16", "model.vocab_size=512"])
    assert make_batches(cfg, None).n_train_windows > 0
    manifest = prepare.read_manifest(data)
    assert all(set(s["sha256"]) == {"bin", "idx"} for s in manifest["splits"]["train"]["shards"])
    for name in ("train-00000.bin", "train-00000.idx"):
        original = (data / name).read_bytes()
        flipped = bytearray(original)
        flipped[5] ^= 1
        (data / name).write_bytes(bytes(flipped))
        with pytest.raises(UserError, match=f"{name} does not match the sha256 in its manifest"):
            make_batches(cfg, None)
        with pytest.raises(UserError, match=f"{name} does not match"):
            prepare.verify(data, manifest)
        (data / name).write_bytes(original)
    assert prepare.verify(data, manifest) == []
    (data / prepare.MANIFEST).unlink()
    with pytest.raises(UserError, match="holds token shards .* but no manifest.json"):
        make_batches(cfg, None)


def test_one_prepare_per_out_and_stale_temporaries_removed(corpus, tmp_path):
    """A second prepare into an --out that a live prepare holds is refused; a killed prepare's
    temporary directory is removed by the next one; the lock is gone afterwards."""
    out = tmp_path / "data"
    lock = tmp_path / ".data.lock"
    lock.write_text(str(os.getpid()))  # a live process holds it
    with pytest.raises(UserError, match=r"is being written by another spmd-data prepare \(pid \d+\)"):
        prepare.prepare([str(corpus / "txt")], str(out), prepare.Options(), progress=False)
    assert not out.exists()
    lock.write_text("999999999")  # a process that is gone
    stale = tmp_path / ".data.tmp-999999999"
    stale.mkdir()
    (stale / "train-00000.bin").write_bytes(b"x")
    prepare.prepare([str(corpus / "txt")], str(out), prepare.Options(), progress=False)
    assert prepare.read_manifest(out)["documents"] == len(DOCS)
    assert not stale.exists() and not lock.exists()


def test_spmd_data_verify_says_what_it_checked(corpus, tmp_path):

    data = _prepared(corpus, tmp_path, "bpe", DOCS * 4)
    cmd = [sys.executable, "-m", "spmd.cli.data", "verify", str(data)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok: {data}: 2 shards"), ok.stderr
    manifest = json.loads((data / prepare.MANIFEST).read_text())
    edited = {**manifest, "documents": manifest["documents"] + 1}  # a count changed by hand
    (data / prepare.MANIFEST).write_text(json.dumps(edited))
    tampered = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert tampered.returncode == 2 and "does not match its own digest" in tampered.stderr, tampered.stderr
    del manifest[prepare.MANIFEST_DIGEST]  # as prepared before digests existed
    for shard in manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"]:
        del shard["sha256"]
    (data / prepare.MANIFEST).write_text(json.dumps(manifest))
    old = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert old.returncode == 0 and "their bytes were not checked" in old.stdout
