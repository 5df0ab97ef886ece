"""A/B of train-step variants in one process: each variant compiled once, then their steps run in
alternating windows (A B C A B C ...), so machine noise hits all alike; prints each variant's
median step and the median over windows of its speed-up against the first.

    python scripts/bench_step_ab.py --config small --set model.dtype=float32 \\
        --variant '' --variant 'model.remat=save_dots' --variant 'xla:xla_cpu_use_xnnpack=false'

A variant is a comma-separated list of config overrides (`section.key=value`) and XLA compiler
options (`xla:name=value`, passed to `compile(compiler_options=...)`); '' is the baseline.
One CPU device unless --devices (fake CPU devices) with --mesh and --rules. Losses are printed too: a variant that only changes speed keeps them (to rounding).
"""

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_variant(text: str) -> tuple[list[str], dict]:
    overrides, options = [], {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item.startswith("xla:"):
            name, _, value = item[4:].partition("=")
            lowered = value.lower()
            options[name] = (
                lowered == "true"
                if lowered in ("true", "false")
                else int(value)
                if value.isdigit()
                else value
            )
        else:
            overrides.append(item)
    return overrides, options


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--set", action="append", default=[], help="override for every variant")
    p.add_argument("--variant", action="append", default=[], help="see above; the first is the baseline")
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices (default 1)")
    p.add_argument("--mesh", default="", help="mesh over --devices (e.g. data=2)")
    p.add_argument("--rules", default="dp")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="steps per window")
    args = p.parse_args()
    if len(args.variant) < 2:
        print("error: give at least two --variant (the first is the baseline; '' for none)", file=sys.stderr)
        raise SystemExit(2)

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    from spmd.assembly.setup import assemble, before_jax_starts
    from spmd.core.errors import UserError
    from spmd.platform import cpu_matmul

    # cpu.host_heap as spmd-train sets it (after jax_platforms, which it reads): without it
    # every window faults the steps' temporaries in again and the variants' ratios shrink.
    before_jax_starts(args.config, args.set, may_relaunch=True)

    runs = []
    for text in args.variant:
        overrides, options = parse_variant(text)
        try:
            setup = assemble(
                args.config, args.mesh, args.rules, overrides=args.set + overrides, devices=jax.devices()
            )
        except UserError as e:
            print(f"error: variant {text!r}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        trainer, batches = setup.trainer, setup.batches()
        state, batch = trainer.init_state(), batches.train_batch(0)
        # kept, as spmd/platform/cpu_matmul.py keeps oneDNN programs (XLA can abort when one is freed)
        step = cpu_matmul.keep(
            trainer.train_step.lower(state, batch).compile(compiler_options=options or None)
        )
        runs.append(
            {"label": text or "(baseline)", "step": step, "state": state, "batch": batch, "times": []}
        )
    for r in range(args.rounds + 1):  # round 0 warms up
        for run in runs:
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                run["state"], metrics = run["step"](run["state"], run["batch"])
                jax.block_until_ready(run["state"])
                times.append(time.perf_counter() - t)
            run["loss"] = float(metrics["loss"])
            if r:
                run["times"].append(statistics.median(times))
    base = runs[0]["times"]
    print(
        f"\n`{args.config}` {args.mesh or '1 device'} {' '.join(args.set)}: {args.rounds} rounds of {args.steps} steps\n"
    )
    print("| variant | step (ms) | speed-up vs baseline | loss after the last step |\n|---|---:|---:|---:|")
    for run in runs:
        speedup = statistics.median(b / t for b, t in zip(base, run["times"], strict=True))
        print(
            f"| `{run['label']}` | {statistics.median(run['times']) * 1e3:,.1f} | {speedup:.3f}x | {run['loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
