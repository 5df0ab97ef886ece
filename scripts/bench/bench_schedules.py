"""Pipeline schedules side by side: memory against the number of microbatches, the bubble
(analytic and counted in the compiled step), compiled FLOPs against the unpipelined step, and CPU
step time.

    python scripts/bench/bench_schedules.py tpu --config llama-8b --topology v5p:4x4x4 --mesh stage=4,fsdp=8,tensor=2
    python scripts/bench/bench_schedules.py flops      # tiny on 8 fake CPU devices, XLA:CPU
    python scripts/bench/bench_schedules.py time [--rounds 3 --steps 4]

`tpu`: the TPU compiler's step (libtpu through jax.experimental.topologies) for gpipe (both ways), 1f1b,
interleaved_1f1b (repeats 2), zb_h1 and interleaved_zb (repeats 2; `--set pipeline.repeats=R` for another) at M = 8, 16, 32 microbatches of a fixed size (`--rows` sequences per
microbatch, so the global batch is M x rows): per-chip peak and temporaries, the bubble analytic
and counted, microbatch chunks in flight, and bytes sent over `stage` (per chip, a scheduled move
counted as every chip sending; and the moves of the busiest stage's chips). Memory flat in M is the
claim: GPipe keeps every microbatch's saved activations until its backward, 1F1B at most S,
interleaved 1F1B 2 R S - 1 chunks (ZB-H1 at most S + 3, and S microbatches' weight-pass inputs
besides; interleaved zero-bubble S chunks' of them).

`flops`: the same comparison on XLA:CPU for `tiny` (8 layers) on stage=4,data=2, where the
compiled matmul FLOPs are parsed (the TPU compiler writes matmuls as convolutions, not parsed),
against data=8 without a pipeline at the same global batch: each schedule's FLOPs over the
unpipelined step's, beside 1 + its counted bubble.

`time`: CPU step time of each schedule beside GPipe's lockstep loop at the same M, in alternating
rounds (A B A B), the median ratio quoted; in one process with JAX's runtime started, whose gloo
collectives the scheduled pipelines' diverging stages need (all schedules then run on them).

Rows: `gpipe_lockstep` is GPipe's lockstep loop (`pipeline.backward=autodiff`), `gpipe` GPipe with
its backward scheduled (`pipeline.backward=scheduled`, what `auto` picks on an accelerator);
`circular_lockstep` and `circular` likewise, with 2 repeats.
"""

import argparse
import os
import statistics
import sys
import time

# (label, overrides): GPipe and circular both ways (the lockstep loop with autodiff's backward;
# the stages apart, the backward scheduled), then the schedules that always schedule theirs
SCHEDULES = (
    ("gpipe_lockstep", ["pipeline.schedule=gpipe", "pipeline.backward=autodiff"]),
    ("gpipe", ["pipeline.schedule=gpipe", "pipeline.backward=scheduled"]),
    ("circular_lockstep", ["pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.backward=autodiff"]),
    ("circular", ["pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.backward=scheduled"]),
    ("1f1b", ["pipeline.schedule=1f1b"]),
    ("interleaved_1f1b", ["pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2"]),
    ("zb_h1", ["pipeline.schedule=zb_h1"]),
    ("interleaved_zb", ["pipeline.schedule=interleaved_zb", "pipeline.repeats=2"]),
)


def _setup(devices_n: int) -> None:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices_n}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def tpu(args) -> None:
    _setup(8)
    from spmd.analysis import topology
    from spmd.analysis.aot import DoesNotFit, dry_run
    from spmd.assembly.setup import assemble
    from spmd.parallel.sharding import fmt_bytes

    devices = topology.devices(args.topology)
    print(f"{args.config} on {args.topology} ({len(devices)} chips), mesh {args.mesh}, {args.rules}, "
          f"{args.rows} sequences per microbatch, remat {args.remat}")  # fmt: skip
    print("| schedule | M | peak | temporaries | bubble analytic | bubble counted | in flight | over stage "
          "| moves, busiest stage |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, extra in SCHEDULES:
        if args.schedules and name not in args.schedules:
            continue
        for m in args.microbatches:
            overrides = [f"pipeline.microbatches={m}", *extra,
                         f"train.global_batch_size={m * args.rows}", f"model.remat={args.remat}", *args.set]  # fmt: skip
            setup = assemble(args.config, args.mesh, args.rules, overrides=overrides, devices=devices)
            try:
                r = dry_run(setup)
            except DoesNotFit as e:
                print(
                    f"| {name} | {m} | does not fit: {str(e).splitlines()[0][:120]} | | | | | | |", flush=True
                )
                continue
            pp, mem = r["pipeline"], r["per_device_bytes"]
            label = f"{name} (R={pp['repeats']})" if pp["repeats"] > 1 else name
            print(
                f"| {label} | {m} | {fmt_bytes(mem['peak'])} | {fmt_bytes(mem['temporaries'])} | "
                f"{pp['bubble_fraction']:.1%} | {pp['bubble_counted']:.1%} | {pp['in_flight']} | "
                f"{fmt_bytes(pp['collective_permute_bytes'] + pp['other_stage_bytes'])} | "
                f"{fmt_bytes(pp['collective_permute_bytes_busiest'])} |",
                flush=True,
            )


def flops(args) -> None:
    _setup(8)
    import jax

    from spmd.analysis.aot import dry_run
    from spmd.assembly.setup import assemble

    devices = jax.devices()
    base = ["model.n_layers=8", "train.seq_len=64"]
    print("tiny (8 layers), stage=4,data=2 against data=8 (no pipeline), XLA:CPU; 8 rows per microbatch")
    print("| schedule | M | compiled FLOPs / unpipelined | 1 + bubble counted | bubble counted |")
    print("|---|---:|---:|---:|---:|")
    for m in args.microbatches:
        batch = [f"train.global_batch_size={8 * m}"]
        flat = dry_run(assemble("tiny", "data=8", "dp", overrides=[*base, *batch], devices=devices))
        f0 = flat["compiled_matmul_flops_per_device"]
        for name, extra in SCHEDULES:
            if args.schedules and name not in args.schedules:
                continue
            overrides = [*base, *batch, f"pipeline.microbatches={m}", *extra]
            r = dry_run(assemble("tiny", "stage=4,data=2", "pp", overrides=overrides, devices=devices))
            b = r["pipeline"]["bubble_counted"]
            print(f"| {name} | {m} | {r['compiled_matmul_flops_per_device'] / f0:.4f} | {1 + b:.4f} | {b:.1%} |",
                  flush=True)  # fmt: skip


def step_time(args) -> None:
    _setup(8)
    from spmd.platform import distributed

    distributed.initialize(diverging_collectives=True)  # the scheduled stages diverge: gloo collectives
    import jax

    from spmd.assembly.setup import assemble

    devices = jax.devices()
    runs = []
    for name, extra in SCHEDULES:
        if args.schedules and name not in args.schedules:
            continue
        overrides = ["model.n_layers=8", "train.global_batch_size=64", "train.seq_len=64",
                     f"pipeline.microbatches={args.m}", *extra]  # fmt: skip
        setup = assemble("tiny", "stage=4,data=2", "pp", overrides=overrides, devices=devices)
        trainer = setup.trainer
        state = trainer.init_state()
        batch = setup.batches().train_batch(0)
        state, _ = trainer.train_step(state, batch)  # compile
        jax.block_until_ready(state)
        runs.append([name, trainer, state, batch, []])
    for _ in range(args.rounds):
        for run in runs:
            name, trainer, state, batch, times = run
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(metrics)
            times.append((time.perf_counter() - t0) / args.steps)
            run[2] = state
    base = runs[0][4]
    print(f"tiny (8 layers), stage=4,data=2, M={args.m}, 8 fake CPU devices; {args.rounds} rounds x "
          f"{args.steps} steps, alternating")  # fmt: skip
    print(f"| schedule | median step | median ratio to {runs[0][0]} |")
    print("|---|---:|---:|")
    for name, _, _, _, times in runs:
        ratio = statistics.median(t / b for t, b in zip(times, base, strict=True))
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} ms | {ratio:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("tpu")
    t.add_argument("--config", default="llama-8b")
    t.add_argument("--topology", default="v5p:4x4x4")
    t.add_argument("--mesh", default="stage=4,fsdp=8,tensor=2")
    t.add_argument("--rules", default="pp_fsdp_tp")
    t.add_argument("--rows", type=int, default=8, help="sequences per pipeline microbatch")
    t.add_argument("--remat", default="full")
    t.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    t.add_argument("--schedules", nargs="*", default=[])
    t.add_argument("--set", nargs="*", default=[])
    f = sub.add_parser("flops")
    f.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    f.add_argument("--schedules", nargs="*", default=[])
    s = sub.add_parser("time")
    s.add_argument("--m", type=int, default=8)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--schedules", nargs="*", default=[], help="labels to time; the first is the base")
    args = p.parse_args()
    {"tpu": tpu, "flops": flops, "time": step_time}[args.mode](args)


if __name__ == "__main__":
    main()
