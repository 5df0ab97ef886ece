"""Pipeline parallelism: step time against the analytic bubble, activation memory
against the number of microbatches, and a large model's dry-run with and without stages.

    python scripts/bench/bench_pipeline.py [--steps 6] [--rounds 2] [--skip-70b]

1. `small` with 8 layers (global batch 64 x 128) on 8 fake CPU devices: GPipe and circular
   (repeats 2) over stage=2 (x data=4) and stage=4 (x data=2) with M = 4, 8, 16 microbatches,
   next to data parallelism on data=8. Each layout is compiled once (its memory read from that
   compile), then timed in rounds that alternate over all layouts (A B C ... A B C ...), so the
   machine's drift falls on every layout alike; the table quotes the median step time of each
   and its ratio to data parallelism. On fake devices the 8 "devices" share the host's cores, so
   idle stages are not idle time: the GSPMD schedule runs every stage on every iteration (the
   bubble's iterations on data that is thrown away), so the step costs (M R + S - 1) / (M R) of
   the work, which is what the `expected` column predicts relative to the M = 16 GPipe row.
2. llama-70b on 256 fake devices: `fsdp=32,tensor=8` (fsdp_tp) against `stage=4,fsdp=8,tensor=8`
   (pp_fsdp_tp, GPipe, M = 16): per-device memory and bytes sent, from the compiled step (XLA:CPU).
"""

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps per layout and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-70b", action="store_true")
    args = p.parse_args()
    n_dev = 8 if args.skip_70b else 256
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_dev}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

    import jax

    from spmd.analysis.aot import dry_run
    from spmd.assembly.setup import assemble
    from spmd.parallel.sharding import fmt_bytes

    devices = jax.devices()
    base = ["model.n_layers=8", "train.global_batch_size=64"]
    layouts = [("dp", "data=8", [], "data parallel")]
    for stages in (2, 4):
        for m in (4, 8, 16):
            mesh = f"stage={stages},data={8 // stages}"
            layouts.append(("pp", mesh, [f"pipeline.microbatches={m}"], f"gpipe S={stages} M={m}"))
            layouts.append(
                (
                    "pp",
                    mesh,
                    [f"pipeline.microbatches={m}", "pipeline.schedule=circular", "pipeline.repeats=2"],
                    f"circular S={stages} M={m} R=2",
                )
            )
    runs = []
    for rules, mesh, extra, label in layouts:
        setup = assemble("small", mesh, rules, overrides=base + extra, devices=devices[:8])
        trainer, batches = setup.trainer, setup.batches()
        state = trainer.init_state()
        batch = batches.train_batch(0)
        t0 = time.perf_counter()
        compiled = trainer.train_step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        state, _ = compiled(state, batch)  # warm-up
        jax.block_until_ready(state)
        runs.append(
            {
                "label": label,
                "schedule": setup.plan.schedule,
                "compiled": compiled,
                "state": state,
                "batch": batch,
                "temp": mem.temp_size_in_bytes,
                "compile_s": compile_s,
                "times": [],
            }
        )
        print(f"compiled {label} in {compile_s:.1f}s", flush=True)
    for _ in range(args.rounds):
        for r in runs:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                r["state"], metrics = r["compiled"](r["state"], r["batch"])
                jax.block_until_ready(metrics)
                r["times"].append(time.perf_counter() - t0)
    dp_median = statistics.median(runs[0]["times"])
    print(
        f"\nsmall (8 layers), batch 64 x 128, 8 fake CPU devices; {args.rounds} rounds x {args.steps} steps"
    )
    print(
        "| layout | bubble (S-1)/(MR+S-1) | work (MR+S-1)/(MR) | step (median) | vs data parallel | temporaries per device |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        sch = r["schedule"]
        bubble = f"{sch.bubble_fraction:.1%}" if sch else "-"
        work = f"{sch.iterations / (sch.microbatches * sch.repeats):.3f}" if sch else "-"
        step = statistics.median(r["times"])
        print(
            f"| {r['label']} | {bubble} | {work} | {step * 1e3:,.0f} ms | {step / dp_median:.2f}x | "
            f"{fmt_bytes(r['temp'])} |"
        )
    if args.skip_70b:
        return
    print("\nllama-70b on 256 fake devices (XLA:CPU dry-run)")
    print(
        "| layout | peak per device | temporaries | params | sent per device | of which between stages | compiled matmul TFLOP per device | compile |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for rules, mesh, extra in (
        ("fsdp_tp", "fsdp=32,tensor=8", []),
        ("pp_fsdp_tp", "stage=4,fsdp=8,tensor=8", ["pipeline.microbatches=16"]),
    ):
        setup = assemble("llama-70b", mesh, rules, overrides=extra, devices=devices[:256])
        r = dry_run(setup)
        b = r["per_device_bytes"]
        pp = r["pipeline"]
        between = fmt_bytes(pp["collective_permute_bytes"] + pp["other_stage_bytes"]) if pp else "-"
        print(
            f"| {rules} {mesh}{' M=16' if extra else ''} | {fmt_bytes(b['peak'])} | {fmt_bytes(b['temporaries'])} | "
            f"{fmt_bytes(b['params'])} | {fmt_bytes(r['collective_volume_bytes'])} | {between} | "
            f"{r['compiled_matmul_flops_per_device'] / 1e12:,.1f} | {r['compile_seconds']:.0f}s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
