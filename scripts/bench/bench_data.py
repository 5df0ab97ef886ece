"""Data benchmarks: spmd-data prepare against the tokenizer library alone, and the data loader's
share of a training step.

1. Prepare throughput: tokens/s of `spmd.data.prepare.prepare` (--workers, reading .jsonl, writing
   shards) over tokens/s of `tokenizers`' own `encode_batch` on the same documents (in memory,
   nothing written), alternating A B A B; the median of the per-round ratios.
2. Loader share: `small` with packed documents from a 3-source mixture; per step, the time to
   build the global batch on the host and put it on the devices, over the step's wall time.

    python scripts/bench/bench_data.py [--rounds 3] [--workers 2] [--megabytes 8] [--steps 20]
"""

import argparse
import json
import pathlib
import statistics
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))


def corpus(megabytes: float) -> list[str]:
    """This Python's standard library source files as documents, up to `megabytes`."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs, size = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        text = f.read_text(errors="replace")
        docs.append(text)
        size += len(text)
        if size >= megabytes * 1e6:
            break
    return docs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--megabytes", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--host-devices", type=int, default=8)
    args = p.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from spmd.data import prepare

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_data-"))
    docs = corpus(args.megabytes)
    jsonl = work / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        docs[:200],
        trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )  # fmt: skip
    tok_path = work / "tokenizer.json"
    tok.save(str(tok_path))
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(docs))

    rows, ratios = [], []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        tok.encode_batch(docs)
        lib = n_tokens / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        opts = prepare.Options(tokenizer=str(tok_path), val_fraction=0.01)
        m = prepare.prepare([str(jsonl)], str(work / f"out{r}"), opts, workers=args.workers, progress=False)
        ours = m["tokens"] / (time.perf_counter() - t0)
        ratios.append(ours / lib)
        rows.append((r, lib, ours))
    print(f"## prepare: {len(docs):,} documents, {n_tokens:,} tokens ({args.megabytes:g} MB of text), "
          f"--workers {args.workers}")  # fmt: skip
    print("| round | tokenizers encode_batch tok/s | spmd-data prepare tok/s | ratio |")
    print("|---|---|---|---|")
    for r, lib, ours in rows:
        print(f"| {r} | {lib:,.0f} | {ours:,.0f} | {ours / lib:.2f} |")
    print(f"median ratio (prepare / encode_batch): {statistics.median(ratios):.2f}\n")

    # 2. The loader's share of a `small` step: packed documents, 3 sources.
    from spmd.cli.common import set_host_devices

    set_host_devices(args.host_devices)
    import jax

    from spmd.assembly.setup import assemble

    thirds = [docs[i::3] for i in range(3)]
    sources = []
    for k, part in enumerate(thirds):
        src = work / f"src{k}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        prepare.prepare([str(src)], str(work / f"src{k}"), prepare.Options(tokenizer=str(tok_path), val_fraction=0.02),
                        workers=args.workers, progress=False)  # fmt: skip
        sources.append({"path": str(work / f"src{k}"), "weight": k + 1})
    setup = assemble("small", f"fsdp={args.host_devices}", "fsdp", overrides=[
        f"data.sources={json.dumps(sources)}", "data.packing=segments", "model.vocab_size=4096"])  # fmt: skip
    trainer, batches = setup.trainer, setup.batches()
    state = trainer.init_state()
    step_fn = trainer.train_step.lower(state, batches.train_batch(0)).compile()
    state, m = step_fn(state, batches.train_batch(0))
    jax.block_until_ready(m)
    shares, data_s, step_s = [], [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = batches.train_batch(step)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        state, m = step_fn(state, batch)
        jax.block_until_ready(m)
        t2 = time.perf_counter()
        data_s.append(t1 - t0)
        step_s.append(t2 - t0)
        shares.append((t1 - t0) / (t2 - t0))
    cfg = setup.cfg.train
    print(f"## loader: small, {cfg.global_batch_size} x {cfg.seq_len} tokens/step, packing segments, 3 sources "
          f"(weights 1:2:3), {args.host_devices} CPU devices, {args.steps} steps")  # fmt: skip
    print("| median data s/step | median step s (data + compute) | median data share |")
    print("|---|---|---|")
    print(
        f"| {statistics.median(data_s):.4f} | {statistics.median(step_s):.4f} | {statistics.median(shares):.2%} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
