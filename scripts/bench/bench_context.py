"""Context-parallel benchmark on fake CPU devices.

    python scripts/bench/bench_context.py                     # both tables
    python scripts/bench/bench_context.py --budget-mib 512    # a different per-device memory budget

Memory: the train step of a long-context variant of `tiny` (batch 1, 8 heads, fp32) is compiled,
not run, under `cp_ring` on `--mesh context=n` for n = 1, 2, 4, 8 (n = 1 is one device with
chunked attention) and T from 2k up; `memory_analysis()` gives each device's arguments,
outputs and temporaries. The
longest T under the budget should grow about linearly with n.

Time: median step time of ring, Ulysses and all-gather context parallelism on `--mesh
context=4`, same model and batch, measured in one run (the fake devices share this machine's
cores, so ratios mean more than absolute times).
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from spmd.analysis import aot  # noqa: E402
from spmd.assembly.setup import assemble  # noqa: E402
from spmd.parallel.sharding import fmt_bytes  # noqa: E402

MODEL = [
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.head_dim=16",
    "model.d_model=128",
    "model.d_ff=384",
    "model.n_layers=2",
]


def setup_for(T, n, rules, batch=1, impl="chunked"):
    sets = MODEL + [
        f"train.seq_len={T}",
        f"train.global_batch_size={batch}",
        f"model.attention_impl={impl}",
        "train.eval_every=0",
    ]
    return assemble("tiny", f"context={n}" if n > 1 else "", rules, overrides=sets, devices=jax.devices()[:n])


def peak_bytes(T, n):
    trainer = setup_for(T, n, "cp_ring" if n > 1 else "dp").trainer
    compiled = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch(1, T)).compile()
    return aot.peak_bytes(compiled.memory_analysis())


def memory_table(budget, lengths):
    print(f"\nPeak memory per device of one train step (batch 1), cp_ring, budget {fmt_bytes(budget)}:\n")
    print("| T | " + " | ".join(f"context={n}" for n in (1, 2, 4, 8)) + " |")
    print("|---:|" + "---:|" * 4)
    longest = {}
    for T in lengths:
        row = []
        for n in (1, 2, 4, 8):
            peak = peak_bytes(T, n)
            if peak <= budget:
                longest[n] = T
            row.append(fmt_bytes(peak) + ("" if peak <= budget else " (over)"))
        print(f"| {T:,} | " + " | ".join(row) + " |", flush=True)
    print("\n| context | longest T within budget | vs context=1 |\n|---:|---:|---:|")
    for n in (1, 2, 4, 8):
        T = longest.get(n)
        print(
            f"| {n} | {T and f'{T:,}' or '-'} | {T / longest[1] if T and longest.get(1) else float('nan'):.0f}x |"
        )


def time_table(T, batch, steps):
    print(f"\nStep time on context=4 (8 heads, T={T:,}, batch {batch}, fp32), median of {steps} steps:\n")
    print("| mode | median step | vs ring |\n|---|---:|---:|")
    medians = {}
    for mode, rules in (("ring", "cp_ring"), ("ulysses", "cp_ulysses"), ("allgather", "allgather")):
        setup = setup_for(T, 4, rules, batch=batch)
        trainer, batches = setup.trainer, setup.batches()
        state = trainer.init_state()
        times = []
        for step in range(steps + 2):
            b = batches.train_batch(step)
            t0 = time.perf_counter()
            state, metrics = trainer.train_step(state, b)
            jax.block_until_ready(metrics["loss"])
            if step >= 2:  # first two: compile and warm-up
                times.append(time.perf_counter() - t0)
        medians[mode] = statistics.median(times)
    for mode, t in medians.items():
        print(f"| {mode} | {t * 1e3:.0f} ms | {t / medians['ring']:.2f}x |")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget-mib", type=float, default=256)
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536")
    parser.add_argument("--time-seq-len", type=int, default=4096)
    parser.add_argument("--time-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {len(jax.devices())} fake CPU devices on {os.cpu_count()} cores")
    if not args.skip_memory:
        memory_table(args.budget_mib * 2**20, [int(x) for x in args.lengths.split(",")])
    if not args.skip_time:
        time_table(args.time_seq_len, args.time_batch, args.steps)


if __name__ == "__main__":
    main()
