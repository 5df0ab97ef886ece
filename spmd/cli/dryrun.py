"""`spmd-dryrun`: per-device memory, FLOPs and collectives of a train step, compiled for a mesh on
fake devices without allocating anything (spmd.analysis.aot)."""

import argparse
import json
import sys

from spmd.cli.common import Parser, add_host_devices, add_run_flags, run_main, set_host_platform


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="spmd-dryrun",
        description="Per-device memory, FLOPs and collectives of a train step, "
        "compiled for a mesh without allocating anything.",
    )
    add_run_flags(p)
    p.add_argument(
        "--topology",
        help="compile for this TPU slice with the TPU compiler (libtpu: pip install '.[tpu]'), "
        "e.g. v5e:4x4, v5p:4x4x4, v6e:8x8; --mesh sizes multiply to its chip count",
    )
    p.add_argument("--num-slices", type=int, default=1, help="--topology slices joined by DCN [1]")
    p.add_argument("--dcn-mesh", default="", help="mesh across slices [data=<num-slices>]")
    p.add_argument(
        "--over-hbm",
        action="store_true",
        help="with --topology: compile a step that does not fit the chip's HBM anyway (the report says "
        "so) to see its memory and collectives, instead of the compiler's refusal",
    )
    p.add_argument(
        "--memory-per-device",
        help="memory budget of each device, with a unit (80GiB, 512MiB): the report says whether the "
        "compiled step fits it, and over it, the levers spmd-plan would take [--topology's HBM per device]",
    )
    add_host_devices(p, "fake CPU devices standing in for the topology", from_env=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--list", action="store_true", help="also list every collective instruction")
    p.add_argument(
        "--explain",
        action="store_true",
        help="attribute each collective to the logical-axis rule (and parameter or activation) behind it",
    )
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), run, argv)


def run(args) -> int:
    from spmd.analysis.aot import dry_run
    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    devices, dcn_mesh = None, args.dcn_mesh
    if args.topology:
        from spmd.analysis import topology

        if args.host_devices is not None:
            raise UserError("--topology and --host-devices both name the devices; give one")
        set_host_platform()
        devices = topology.devices(args.topology, args.num_slices, over_hbm=args.over_hbm)
        dcn_mesh = dcn_mesh or (f"data={args.num_slices}" if args.num_slices > 1 else "")
    elif args.num_slices != 1:
        raise UserError("--num-slices needs --topology")
    elif args.over_hbm:
        raise UserError("--over-hbm needs --topology (XLA:CPU has no memory limit to go over)")
    from spmd.assembly import planner

    budget = planner.parse_bytes(args.memory_per_device) if args.memory_per_device else None
    setup = assemble(
        args.config, args.mesh, args.rules, overrides=args.set, devices=devices, dcn_mesh=dcn_mesh
    )
    report = dry_run(setup, list_instructions=args.list, explain=args.explain)
    if budget is None and report["chip_estimate"]:
        budget = int(report["chip_estimate"]["hbm_per_device"])
    report["verdict"] = planner.verdict(setup.cfg, report, budget) if budget is not None else None
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def _t(seconds: float) -> str:
    return f"{seconds:.3f}s" if seconds >= 0.1 else f"{seconds * 1e3:.3f}ms"


def print_report(r: dict) -> None:
    from spmd.core.mesh import format_mesh
    from spmd.parallel.sharding import fmt_bytes

    mesh = format_mesh(r["mesh"])
    print(
        f"{r['config']} on {mesh} ({r['devices']} devices), rules {r['rules']}: compiled in {r['compile_seconds']:.1f}s\n"
    )
    notes = {
        "peak": "  device memory: arguments + outputs - aliased + temporaries - host",
        "host": "  host memory (pinned_host): offloaded optimizer state, host temporaries",
        "gradients": "  as the update takes them",
        "frozen_params": "  of the params: frozen by a model transform (no gradients, no optimizer state)",
        "reference_params": "  of the params: the reference model of a preference objective (frozen, a copy)",
    }
    print("per device:")
    for k, v in r["per_device_bytes"].items():
        print(f"  {k:<16} {fmt_bytes(v):>12}{notes.get(k, '')}")
        if k == "optimizer_state":
            for kind, n in r["optimizer_state_by_kind"].items():
                print(f"    {kind:<22} {fmt_bytes(n):>12}")
    print(
        f"  model FLOPs      {r['model_flops_per_device'] / 1e9:,.3f} GFLOP per step "
        f"({r['model_flops_per_step'] / 1e9:,.3f} in all)\n"
        + (
            f"  compiled matmuls {r['compiled_matmul_flops_per_device'] / 1e9:,.3f} GFLOP per step per device "
            f"(what runs: recomputation and idle pipeline stages included)\n"
            if r["compiled_matmul_flops_per_device"] is not None
            else "  compiled matmuls n/a (the TPU compiler writes them as convolutions)\n"
        )
        + (
            f"  Pallas kernel calls {r['kernel_calls_per_step']:,} per step "
            f"({r['kernel_calls_per_layer']:g} per layer: the attention's forward and backward)\n"
            if r["kernel_calls_per_step"]
            else ""
        )
    )
    pp = r.get("pipeline")
    if pp:
        print(
            f"pipeline: {pp['schedule']} ({pp['backward']} backward), {pp['stages']} stages x "
            f"{pp['microbatches']} microbatches"
            + (f" x {pp['repeats']} repeats" if pp["repeats"] > 1 else "")
            + f": {pp['iterations']} iterations, bubble {pp['bubble_fraction']:.1%} = {pp['bubble_formula']}"
            + (
                f" (counted in the compiled step: {pp['bubble_counted']:.1%}; ticks forward "
                f"{pp['ticks_counted']['forward']}, backward {pp['ticks_counted']['backward']}"
                + (f", weight {pp['ticks_counted']['weight']}" if "weight" in pp["ticks_counted"] else "")
                + ")"
                if pp["bubble_counted"] is not None
                else ""
            )
            + f"\n  microbatch chunks in flight per stage: at most {pp['in_flight']}\n"
            f"  sent to the next stage (collective-permutes): {fmt_bytes(pp['collective_permute_bytes'])} "
            f"per device ({fmt_bytes(pp['collective_permute_bytes_busiest'])} by each device of the busiest "
            f"stage); other collectives over stage: {fmt_bytes(pp['other_stage_bytes'])}\n"
        )
    bs = r.get("between_slices")
    if bs:
        dtypes = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(bs["by_dtype"].items()))
        print(
            f"between slices ({bs['slices']}; sync {bs['method']}, compress {bs['compress']}): "
            f"{fmt_bytes(bs['sent_bytes_per_step'])} sent per step per device ({dtypes or 'nothing'})"
        )
        if bs["sent_bytes_per_sync"]:
            per_sync = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(bs["by_dtype_per_sync"].items()))
            print(
                f"  and {fmt_bytes(bs['sent_bytes_per_sync'])} per sync ({per_sync}), each fragment every "
                f"{bs['inner_steps']} steps: {fmt_bytes(bs['amortised_bytes_per_step'])} per step amortised"
            )
        print(
            f"  analytic: {fmt_bytes(bs['analytic_bytes_per_step'])} per step; the plain all-reduce "
            f"{fmt_bytes(bs['analytic_allreduce_bytes_per_step'])}\n"
        )
    est = r.get("chip_estimate")
    if est:
        print(
            f"{r['device_kind']} ({est['chip']}): {fmt_bytes(est['hbm_per_device'])} HBM per device; the compiled "
            f"peak {'fits' if est['fits'] else 'does NOT fit'}\n"
            f"  est. step {_t(est['step_s'])} = compute {_t(est['compute_s'])} at "
            f"{est['hardware']['peak'] / 1e12:.0f} TFLOP/s + communication {_t(est['comm_s'])} "
            f"(the bytes below over ICI {est['hardware']['ici'] / 1e9:.0f} GB/s"
            + (f", DCN axes {','.join(est['dcn_axes'])}" if est["dcn_axes"] else "")
            + f"; not overlapped): MFU {est['mfu']:.1%}\n"
        )
    v = r.get("verdict")
    if v:
        if v["fits"]:
            print(f"verdict: fits ({fmt_bytes(v['need'])} of {fmt_bytes(v['budget'])} per device)\n")
        else:
            flags = " ".join(f"--set {lv}" for lv in v["levers"] if " " not in lv)
            levers = "; ".join([flags] * bool(flags) + [lv for lv in v["levers"] if " " in lv])
            predicted = (
                f" (predicted {fmt_bytes(v['predicted'])} from the measured activations; compile it to check)"
                if "predicted" in v
                else ""
            )
            print(
                f"verdict: over by {fmt_bytes(v['over'])} ({fmt_bytes(v['need'])} of {fmt_bytes(v['budget'])} "
                f"per device); spmd-plan would take: {levers}{predicted}\n"
            )
    for note in r.get("notes", []):
        print(f"note: {note}")
    backend = "TPU compiler" if r["platform"] == "tpu" else f"XLA {r['platform'].upper()} backend"
    print(f"collectives per step ({backend}), per device:")
    print(f"  {'kind':<20} {'mesh axes':<18} {'count':>7} {'result bytes':>14} {'sent (ring)':>14}")
    for row in r["collectives"]:
        print(
            f"  {row['kind']:<20} {','.join(row['axes']) or '-':<18} {row['count']:>7} "
            f"{fmt_bytes(row['result_bytes']):>14} {fmt_bytes(row['volume_bytes']):>14}"
        )
    total, minimum = r["collective_volume_bytes"], r["analytic_minimum_total"]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["analytic_minimum_bytes"].items() if v)
    ratio = f"{total / minimum:.2f}x" if minimum else "n/a"
    print(
        f"\n  sent in all {fmt_bytes(total)}; analytic minimum {fmt_bytes(minimum)} ({parts or 'none'}); ratio {ratio}"
    )
    if r.get("explain"):
        ex = r["explain"]
        print("\nwhy (--explain): bytes sent per step by the rule that causes them")
        print(f"  {'rule':<26} {'kind':<20} {'count':>7} {'sent (ring)':>14}  what")
        for row in ex["rules"]:
            print(
                f"  {row['rule']:<26} {row['kind']:<20} {row['count']:>7} "
                f"{fmt_bytes(row['volume_bytes']):>14}  {row['what']}"
            )
        if ex["as_all_reduce_excess_bytes"] and minimum:
            one_way = total - ex["as_all_reduce_excess_bytes"]
            print(
                f"  of which {fmt_bytes(ex['as_all_reduce_excess_bytes'])} because gathers or reduce-scatters ran "
                f"as all-reduces (twice the bytes; the compiler's choice): {fmt_bytes(one_way)} as one-way "
                f"collectives, {one_way / minimum:.2f}x the minimum"
            )
        for row in ex["unexplained"]:
            print(
                f"  {'(unexplained)':<26} {row['kind']:<20} {row['count']:>7} {fmt_bytes(row['volume_bytes']):>14}  "
                f"over {','.join(row['axes']) or '-'}, shapes {row['shapes']}, from {row['op_name'] or '?'}"
            )
    for row in r["instructions"] or []:
        print(
            f"  {row['name']:<28} {row['kind']:<20} {','.join(row['axes']) or '-':<14} x{row['count']:<5} "
            f"{fmt_bytes(row['bytes']):>12}  in {row['computation']}"
        )


if __name__ == "__main__":
    sys.exit(main())
