"""`spmd-dryrun`: per-device memory, FLOPs and collectives of a train step, compiled for a mesh on
fake devices without allocating anything (spmd.dryrun)."""

import argparse
import json
import sys

from spmd.cli.common import Parser, add_host_devices, run_main


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="spmd-dryrun",
        description="Per-device memory, FLOPs and collectives of a train step, "
        "compiled for a mesh without allocating anything.",
    )
    p.add_argument("--config", default="small")
    p.add_argument("--mesh", default="fsdp=-1")
    p.add_argument("--rules", default="fsdp")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_host_devices(p, "fake CPU devices standing in for the topology", from_env=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--list", action="store_true", help="also list every collective instruction")
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), run, argv)


def run(args) -> int:
    from spmd.dryrun import dry_run
    from spmd.setup import assemble

    report = dry_run(
        assemble(args.config, args.mesh, args.rules, overrides=args.set), list_instructions=args.list
    )
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def print_report(r: dict) -> None:
    from spmd.mesh import format_mesh
    from spmd.sharding import fmt_bytes

    mesh = format_mesh(r["mesh"])
    print(
        f"{r['config']} on {mesh} ({r['devices']} devices), rules {r['rules']}: compiled in {r['compile_seconds']:.1f}s\n"
    )
    notes = {
        "peak": "  device memory: arguments + outputs - aliased + temporaries - host",
        "host": "  host memory (pinned_host): offloaded optimizer state, host temporaries",
        "gradients": "  as the update takes them",
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
    )
    print("collectives per step (XLA CPU backend), per device:")
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
    for row in r["instructions"] or []:
        print(
            f"  {row['name']:<28} {row['kind']:<20} {','.join(row['axes']) or '-':<14} x{row['count']:<5} "
            f"{fmt_bytes(row['bytes']):>12}  in {row['computation']}"
        )


if __name__ == "__main__":
    sys.exit(main())
