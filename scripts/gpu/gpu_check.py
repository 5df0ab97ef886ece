"""The prepared GPU check: every attention implementation against the reference, the flash
kernel's block sizes swept against cuDNN, and the train step against PyTorch on the same GPU.

    bash scripts/gpu/gpu_check.sh [SECTIONS]      # on the GPU machine (installs the carried .whl/)
    python scripts/gpu/gpu_check.py --smoke       # this host: every part at toy sizes, on CPU

SECTIONS: a comma-separated subset of correctness, sweep, train [all three]. Each section prints
its markdown table as soon as it is done; `--out DIR` (default $OUT, else gpu_check/) gets
gpu_check.md (the tables), gpu_check.json and, from the sweep, tuned.toml: the measured table
for kernels/tuned.toml (spmd.kernels.tuning: what `auto` runs and the kernel's block sizes).

- correctness: fresh random inputs, causal GQA, with and without packed documents; each
  implementation's output and gradients against the float32 reference (flash_attention's
  attention_reference), in bfloat16 and float32 (cuDNN: 16-bit only). Error: max |ours - ref| /
  max |ref|.
- sweep: per shape (T, head dim; 16k tokens, GQA 4:1), cuDNN and the flash kernel at its default
  blocks, then block sizes, Triton warps and stages in priority order until the shape's time
  budget is spent; forward and forward+backward TFLOP/s (4 B N T^2 H / 2 forward, 2.5x that for
  both).
- train: the llama-1b shape, one device, bf16 compute: our step (`auto`, which reads the table, and
  the flash kernel) against the same model in PyTorch (SDPA, fused AdamW, bf16 autocast,
  torch.compile), alternating windows (A B A B), the median of the ratios.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
SECTIONS = ("correctness", "sweep", "train")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def timed(f, *args, reps: int) -> float:
    """Median seconds of f(*args) after one warm-up call."""
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def qkv(B, T, N, K, H, dtype, seed=0):
    import jax

    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k, v = (jax.random.normal(kk, (B, T, K, H), dtype) for kk in keys[1:3])
    return q, k, v, keys[3]


def implementations(gpu: bool) -> dict:
    from spmd.models.attention import ATTENTION_IMPLS

    names = ["xla", "chunked", "pallas"] + (["cudnn"] if gpu else [])
    return {name: ATTENTION_IMPLS[name] for name in names}


# ---------------------------------------------------------------- correctness


def correctness(smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from spmd.kernels.flash_attention import attention_reference

    gpu = jax.devices()[0].platform == "gpu"
    B, T, N, K, H = (1, 64, 4, 2, 16) if smoke else (2, 1024, 8, 2, 128)
    rows = []
    for dtype in ("bfloat16", "float32"):
        q, k, v, key = qkv(B, T, N, K, H, jnp.dtype(dtype), seed=1)
        do = jax.random.normal(key, q.shape, q.dtype)
        # Three documents per row, restarting where they end.
        seg = jnp.broadcast_to(
            jnp.searchsorted(jnp.array([T // 3, 2 * T // 3]), jnp.arange(T), side="right"), (B, T)
        )
        for segments in (False, True):
            kw = {"segment_ids_BT": seg} if segments else {}

            def ref(q, k, v, kw=kw):
                up = (x.astype(jnp.float32) for x in (q, k, v))
                return attention_reference(*up, causal=True, **kw)[0]

            ref_out, ref_vjp = jax.vjp(ref, q, k, v)
            ref_grads = ref_vjp(do.astype(jnp.float32))
            for name, fn in implementations(gpu).items():
                if name == "cudnn" and dtype == "float32":
                    continue  # cuDNN fused attention is 16-bit only (refused at assembly)
                row = {"impl": name, "dtype": dtype, "segments": segments}
                try:
                    out, vjp = jax.vjp(lambda q, k, v, fn=fn, kw=kw: fn(q, k, v, causal=True, **kw), q, k, v)
                    grads = vjp(do)
                    for what, ours, theirs in zip(
                        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)
                    ):
                        err = jnp.max(jnp.abs(ours.astype(jnp.float32) - theirs)) / jnp.max(jnp.abs(theirs))
                        row[what] = float(err)
                except Exception as e:  # noqa: BLE001 — reported in the table, the check goes on
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append(row)
                log(f"correctness {row}")
    return rows


def correctness_table(rows) -> str:
    out = [
        "| impl | dtype | segments | out | dq | dk | dv |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        errs = (
            [r["failed"], "", "", ""] if "failed" in r else [f"{r[k]:.1e}" for k in ("out", "dq", "dk", "dv")]
        )
        out.append(f"| {r['impl']} | {r['dtype']} | {r['segments']} | " + " | ".join(errs) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- block-size sweep


def candidates():
    """BlockSizes fields to try after the defaults, in priority order (larger forward tiles first:
    what reached 0.58-0.80x cuDNN by hand)."""
    for fwd in ((128, 64), (128, 128), (64, 128)):
        for bwd in ((64, 64), (64, 32), (128, 64)):
            for warps in (4, 8):
                yield {"block_q": fwd[0], "block_k": fwd[1], "block_q_bwd": bwd[0], "block_k_bwd": bwd[1],
                       "num_warps": warps}  # fmt: skip
    for stages in (2, 3, 4):
        yield {"num_stages": stages}  # applied to the best so far


def throughput(fn, q, k, v, reps: int) -> tuple[float, float]:
    """(forward, forward+backward) TFLOP/s of causal attention fn(q, k, v)."""
    import jax
    import jax.numpy as jnp

    B, T, N, H = q.shape
    flops = 4 * B * N * T * T * H / 2
    fwd = jax.jit(lambda q, k, v: fn(q, k, v, causal=True))
    both = jax.jit(
        jax.grad(lambda q, k, v: fn(q, k, v, causal=True).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    )
    t_fwd, t_both = timed(fwd, q, k, v, reps=reps), timed(both, q, k, v, reps=reps)
    return flops / t_fwd / 1e12, 2.5 * flops / t_both / 1e12


def sweep(smoke: bool, budget_s: float) -> tuple[list[dict], list]:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from spmd.kernels import tuning
    from spmd.kernels.flash_attention import BlockSizes, flash_attention

    gpu = jax.devices()[0].platform == "gpu"
    kind = jax.devices()[0].device_kind
    shapes = ((64, 16), (128, 16)) if smoke else ((2048, 128), (8192, 128), (2048, 64), (8192, 64))
    tokens, reps = (128, 2) if smoke else (16384, 10)
    rows, measured = [], []
    for T, H in shapes:
        B, N = max(1, tokens // T), (64 if smoke else 2048) // H
        q, k, v, _ = qkv(B, T, N, N // 4, H, jnp.bfloat16)
        row = {"T": T, "H": H}
        if gpu:
            row["cudnn"] = throughput(
                lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
                q, k, v, reps,
            )  # fmt: skip

        def pallas(bs):
            return lambda q, k, v, causal: flash_attention(
                q, k, v, causal=causal, block_sizes=bs, interpret=not gpu
            )

        best_bs, best = BlockSizes(), throughput(pallas(BlockSizes()), q, k, v, reps)
        row["pallas_default"], tried, start = best, 1, time.perf_counter()
        for fields in candidates():
            if time.perf_counter() - start > budget_s:
                break
            try:
                bs = dataclasses.replace(best_bs if "num_stages" in fields else BlockSizes(), **fields)
                got = throughput(pallas(bs), q, k, v, reps)
            except Exception as e:  # noqa: BLE001 — a tile Triton cannot compile: skipped
                log(f"sweep T {T} H {H} {fields}: {type(e).__name__}")
                continue
            tried += 1
            if got[1] > best[1]:
                best_bs, best = bs, got
        row.update(pallas_best=best, blocks=dataclasses.asdict(best_bs), tried=tried)
        rows.append(row)
        log(f"sweep {row}")
        tflops = {"pallas": round(best[1], 1)}
        if "cudnn" in row:
            tflops["cudnn"] = round(row["cudnn"][1], 1)
        blocks = {k: v for k, v in dataclasses.asdict(best_bs).items() if v is not None}
        measured.append(
            tuning.Measured(
                kind, "bfloat16", H, T, max(tflops, key=tflops.get), tflops, blocks,
                f"{time.strftime('%Y-%m-%d')}, scripts/gpu/gpu_check.py sweep ({tried} kernel configs, causal GQA 4:1, "
                f"{tokens} tokens, jax {jax.__version__})",
            )
        )  # fmt: skip
    return rows, measured


def sweep_table(rows) -> str:
    out = [
        "| T | H | cuDNN fwd | cuDNN fwd+bwd | pallas default fwd+bwd | pallas best fwd | pallas best fwd+bwd "
        "| best / cuDNN (fwd, fwd+bwd) | blocks (of tried) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c = r.get("cudnn", (float("nan"), float("nan")))
        b = r["pallas_best"]
        blocks = ", ".join(f"{k} {v}" for k, v in r["blocks"].items() if v is not None)
        out.append(
            f"| {r['T']} | {r['H']} | {c[0]:.0f} | {c[1]:.0f} | {r['pallas_default'][1]:.0f} | {b[0]:.0f} | "
            f"{b[1]:.0f} | {b[0] / c[0]:.2f}x, {b[1] / c[1]:.2f}x | {blocks} ({r['tried']}) |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------- train step vs PyTorch


class TorchWorker:
    """scripts/bench/torch_side.py in its own process (its memory apart from ours), one window per call."""

    def __init__(self, python: str, spec: dict):
        self.proc = subprocess.Popen(
            [python, str(ROOT / "scripts" / "bench" / "torch_side.py"), "--spec", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT / "scripts",
        )  # fmt: skip
        self.ready = self._answer()

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise RuntimeError(f"torch_side.py exited with {self.proc.wait()}")

    def window(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=60)


def train_rows(smoke: bool, torch_python: str | None, rounds: int, steps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from spmd.assembly.setup import assemble
    from spmd.loop.metrics import peak_flops

    config = "tiny" if smoke else "llama-1b"
    shapes = ((4, 64),) if smoke else ((8, 2048), (2, 8192))
    remats = ("none",) if smoke else ("none", "save_dots")
    impls = ("auto",) if smoke else ("auto", "pallas")
    rows = []
    for B, T in shapes:
        worker = None
        if torch_python:
            setup = assemble(config, "", "dp", overrides=[f"train.seq_len={T}"], optimizer=False,
                             devices=jax.devices()[:1])  # fmt: skip
            m = setup.cfg.model
            spec = {
                "kind": "train", "vocab_size": m.vocab_size, "d_model": m.d_model, "n_layers": m.n_layers,
                "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "d_ff": m.d_ff,
                "rope_theta": m.rope_theta, "tie_embeddings": m.tie_embeddings, "dtype": "bfloat16",
                "batch": B, "seq_len": T, "compile": not smoke, "warmup": 3, "steps": steps,
                "device": "cpu" if smoke else "cuda",
            }  # fmt: skip
            worker = TorchWorker(torch_python, spec)
        for remat in remats:
            for impl in impls:
                overrides = [
                    f"train.seq_len={T}", f"train.global_batch_size={B}", "train.microbatches=1",
                    f"model.remat={remat}", f"model.attention_impl={impl}", "model.dtype=bfloat16",
                ]  # fmt: skip
                row = {"batch": B, "seq_len": T, "remat": remat, "attention": impl}
                try:
                    setup = assemble(config, "", "dp", overrides=overrides, devices=jax.devices()[:1])
                    trainer = setup.trainer
                    row["attention"] = setup.attention
                    state = trainer.init_state()
                    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, setup.cfg.model.vocab_size)
                    batch = {
                        "inputs": jax.device_put(tokens[:, :-1].astype(jnp.int32), setup.plan.batch_sharding),
                        "targets": jax.device_put(tokens[:, 1:].astype(jnp.int32), setup.plan.batch_sharding),
                    }
                    for _ in range(3):  # compile and warm up
                        state, metrics = trainer.train_step(state, batch)
                    jax.block_until_ready(metrics)
                    ours, theirs = [], []
                    for _ in range(rounds):  # A B A B
                        t = time.perf_counter()
                        for _ in range(steps):
                            state, metrics = trainer.train_step(state, batch)
                        jax.block_until_ready(metrics)
                        ours.append((time.perf_counter() - t) / steps)
                        if worker is not None:
                            theirs.append(worker.window()["time"])
                    figures = setup.plan.family.figures(setup.cfg.model, T)
                    peak, _ = peak_flops("bfloat16")
                    row["tok_s"] = B * T / statistics.median(ours)
                    row["mfu"] = row["tok_s"] * figures.flops_per_token / peak
                    if theirs:
                        row["torch_tok_s"] = B * T / statistics.median(theirs)
                        row["ratio"] = statistics.median(b / a for a, b in zip(ours, theirs))
                    del state
                except Exception as e:  # noqa: BLE001 — reported in the table (out of memory included)
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                log(f"train {row}")
        if worker is not None:
            worker.close()
    return rows


def train_table(rows) -> str:
    out = [
        "| batch x seq | remat | attention | ours tok/s | MFU | torch.compile tok/s | ours / torch (median of A B ratios) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['batch']} x {r['seq_len']} | {r['remat']} | {r['attention']} |"
        if "failed" in r:
            out.append(f"{head} {r['failed']} | | | |")
            continue
        torch_ = f"{r['torch_tok_s']:,.0f}" if "torch_tok_s" in r else "not run"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        out.append(f"{head} {r['tok_s']:,.0f} | {r['mfu']:.0%} | {torch_} | {ratio} |")
    return "\n".join(out)


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sections", nargs="?", default=",".join(SECTIONS), help=f"subset of {', '.join(SECTIONS)}")
    p.add_argument(
        "--smoke", action="store_true", help="toy sizes on this host's CPU: checks the script runs"
    )
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check")
    p.add_argument("--sweep-seconds", type=float, default=25.0, help="time budget of each shape's sweep [25]")
    p.add_argument("--rounds", type=int, default=3, help="A B windows per train row [3]")
    p.add_argument("--steps", type=int, default=5, help="train steps per window [5]")
    p.add_argument(
        "--torch-python", default=None,
        help="the Python with torch for PyTorch's side; '' for none [this one on a GPU; .venv-torch's with --smoke]",
    )  # fmt: skip
    args = p.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"error: unknown section {unknown[0]!r}; sections are {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:  # room beside us for PyTorch's side on the same GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    import jax

    torch_python = args.torch_python or None  # "": PyTorch's side not run
    if args.torch_python is None:
        local = ROOT / ".venv-torch" / "bin" / "python"
        torch_python = (
            str(local) if args.smoke and local.exists() else (None if args.smoke else sys.executable)
        )
    device = jax.devices()[0]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = (
        f"gpu_check {time.strftime('%Y-%m-%d %H:%M')}: {jax.device_count()} x {device.device_kind} "
        f"({device.platform}), jax {jax.__version__}{', smoke sizes' if args.smoke else ''}"
    )
    log(head)
    report, tables = {"header": head}, [head]
    if "correctness" in sections:
        report["correctness"] = correctness(args.smoke)
        tables.append(
            "## Attention against the float32 reference\n\n" + correctness_table(report["correctness"])
        )
        print(tables[-1] + "\n", flush=True)
    if "sweep" in sections:
        from spmd.kernels import tuning

        rows, measured = sweep(args.smoke, args.sweep_seconds)
        report["sweep"] = rows
        (out / "tuned.toml").write_text(tuning.to_toml(measured))
        tables.append("## Attention TFLOP/s (causal GQA, bf16)\n\n" + sweep_table(rows))
        print(tables[-1] + "\n", flush=True)
    if "train" in sections:
        report["train"] = train_rows(args.smoke, torch_python, args.rounds, args.steps)
        tables.append("## Train step (one device, bf16)\n\n" + train_table(report["train"]))
        print(tables[-1] + "\n", flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
