"""Training throughput of `small`: 1 device and 8 simulated devices under each preset, the measured
matmul peak, and the ratio to a PyTorch eager implementation of the same model and batch.

    python scripts/bench/bench_train.py [--steps 20] [--torch-python .venv-torch/bin/python]

Every configuration runs in its own process (the simulated device count is fixed at JAX start-up);
tokens/s come from the median step time after warm-up. Prints a Markdown table.
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

CASES = [  # (label, devices, mesh, rules, extra --set)
    ("1 device", 1, "", "dp", []),
    ("1 device, fp32 compute", 1, "", "dp", ["model.dtype=float32"]),
    ("8 dev dp", 8, "data=8", "dp", []),
    ("8 dev fsdp", 8, "fsdp=8", "fsdp", []),
    ("8 dev tp", 8, "data=4,tensor=2", "tp", []),
    ("8 dev fsdp_tp", 8, "fsdp=4,tensor=2", "fsdp_tp", []),
    ("8 dev data x fsdp x tensor", 8, "data=2,fsdp=2,tensor=2", "fsdp_tp", []),
]


def worker(args) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    from spmd.assembly.setup import assemble

    setup = assemble(args.config, args.mesh, args.rules, overrides=args.set)
    cfg, trainer, batches = setup.cfg, setup.trainer, setup.batches()
    state = trainer.init_state()
    step_fn = trainer.train_step.lower(state, batches.train_batch(0)).compile()
    times = []
    for step in range(args.warmup + args.steps):
        batch = batches.train_batch(step)
        t = time.perf_counter()
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(state)
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    step_time = statistics.median(times)
    tok_s = cfg.train.global_batch_size * cfg.train.seq_len / step_time
    print(
        json.dumps(
            {
                "tokens_per_sec": tok_s,
                "step_time": step_time,
                "dtype": cfg.model.dtype,
                "flops_per_token": setup.plan.family.figures(cfg.model, cfg.train.seq_len).flops_per_token,
                "loss": float(metrics["loss"]),
            }
        )
    )


def run_json(cmd) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"error: benchmark process failed: {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--torch-python", default=str(ROOT / ".venv-torch" / "bin" / "python"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--mesh", default="", help=argparse.SUPPRESS)
    p.add_argument("--rules", default="dp", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import jax

    jax.config.update("jax_platforms", "cpu")
    from spmd.assembly import policy
    from spmd.assembly.config import load_config
    from spmd.loop.metrics import MATMUL_N, measure_matmul_flops

    cfg = load_config(args.config)
    m = cfg.model
    # each dtype's rate in the library its steps run their matmuls in (cpu.matmul's default)
    peaks = {dt: measure_matmul_flops(dt, reps=21, library=policy.matmul("auto", "cpu", dt))
             for dt in ("float32", "bfloat16")}  # fmt: skip
    rows = []
    for label, devices, mesh, rules, sets in CASES:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--config",
            args.config,
            "--devices",
            str(devices),
            "--mesh",
            mesh,
            "--rules",
            rules,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        for s in sets:
            cmd += ["--set", s]
        r = run_json(cmd)
        rows.append((label, r))
        print(f"  {label}: {r['tokens_per_sec']:,.0f} tok/s", file=sys.stderr, flush=True)
    torch_rows = []
    for torch_dtype in ("float32", "bfloat16") if os.path.exists(args.torch_python) else ():
        torch_rows.append(
            run_json(
                [
                    args.torch_python,
                    str(ROOT / "scripts" / "bench" / "bench_torch.py"),
                    "--vocab-size",
                    str(m.vocab_size),
                    "--d-model",
                    str(m.d_model),
                    "--n-layers",
                    str(m.n_layers),
                    "--n-heads",
                    str(m.n_heads),
                    "--n-kv-heads",
                    str(m.n_kv_heads),
                    "--head-dim",
                    str(m.head_dim),
                    "--d-ff",
                    str(m.d_ff),
                    "--batch",
                    str(cfg.train.global_batch_size),
                    "--seq-len",
                    str(cfg.train.seq_len),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--rope-theta",
                    str(m.rope_theta),
                    "--dtype",
                    torch_dtype,
                ]
            )
        )
    torch_row = torch_rows[0] if torch_rows else None

    print(
        f"\n`{args.config}`: {cfg.model_family.figures(m, cfg.train.seq_len).params:,} params, batch {cfg.train.global_batch_size} x "
        f"{cfg.train.seq_len} tokens, {os.cpu_count()} CPU cores, jax {jax.__version__}, "
        f"median of {args.steps} steps after {args.warmup} warm-up\n"
    )
    print(
        f"Measured matmul peak ({MATMUL_N}x{MATMUL_N}): float32 {peaks['float32'] / 1e9:,.1f} GFLOP/s, "
        f"bfloat16 {peaks['bfloat16'] / 1e9:,.1f} GFLOP/s\n"
    )
    print(
        "| run | compute | tokens/s | step (ms) | MFU vs fp32 peak | MFU vs bf16 peak | vs PyTorch eager fp32 | vs PyTorch eager, same dtype |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, r in rows + [(f"PyTorch {t['torch']} eager, {t['threads']} threads", t) for t in torch_rows]:
        ratio = f"{r['tokens_per_sec'] / torch_row['tokens_per_sec']:.2f}x" if torch_row else "n/a"
        same_t = [t for t in torch_rows if t["dtype"] == r["dtype"]]
        same = f"{r['tokens_per_sec'] / same_t[0]['tokens_per_sec']:.2f}x" if same_t else "n/a"
        flops = r["tokens_per_sec"] * r["flops_per_token"]
        print(
            f"| {label} | {r['dtype']} | {r['tokens_per_sec']:,.0f} | {r['step_time'] * 1e3:.1f} | "
            f"{flops / peaks['float32']:.1%} | {flops / peaks['bfloat16']:.1%} | {ratio} | {same} |"
        )
    if not torch_rows:
        print(f"\n(no PyTorch baseline: {args.torch_python} not found; see docs/performance.md)")


if __name__ == "__main__":
    main()
