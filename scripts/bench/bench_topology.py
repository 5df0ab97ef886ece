"""Dry-runs with the TPU compiler next to XLA:CPU's: per-chip memory, bytes sent against
the analytic minimum, and the datasheet estimate of step time and MFU, for each preset.

    python scripts/bench/bench_topology.py [--rows llama-8b:v5p:4x4x4:fsdp:fsdp=64,...] [--set KEY=VALUE ...]

Each row runs `spmd-dryrun --json --explain` twice: `--topology` (libtpu: pip install '.[tpu]')
and `--host-devices N` (XLA:CPU), in separate processes, and prints one Markdown table. A step the
TPU compiler refuses (it does not fit the chip's HBM) is reported as such.
"""

import argparse
import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
DEFAULT_ROWS = ",".join(
    f"llama-8b:v5p:4x4x4:{rules}:{mesh}"
    for rules, mesh in [
        ("dp", "data=64"),
        ("dp_zero1", "data=64"),
        ("fsdp", "fsdp=64"),
        ("tp", "data=16/tensor=4"),
        ("fsdp_tp", "fsdp=16/tensor=4"),
    ]
)


def dryrun(config, mesh, rules, sets, device_flags, timeout):
    cmd = [sys.executable, "-m", "spmd.cli.dryrun", "--config", config, "--mesh", mesh]
    cmd += ["--rules", rules, "--json", "--explain", *device_flags]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=DEFAULT_ROWS, help="config:generation:shape:rules:mesh (mesh axes by /)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every dry-run")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument(
        "--backends", default="TPU,XLA:CPU", help="which compilers to run each row on [TPU,XLA:CPU]"
    )
    p.add_argument(
        "--over-hbm", action="store_true", help="compile TPU rows that do not fit anyway (peak marked 'over')"
    )
    args = p.parse_args()
    gib = lambda n: f"{n / 2**30:,.2f}"  # noqa: E731
    print(
        "| config | topology | rules | mesh | backend | peak / chip (GiB) | HBM | sent (GiB) | sent / min "
        "| one-way / min | unexplained (GiB) | est. step (s) | est. MFU | compile (s) | sent by kind: count, GiB "
        "| Pallas calls / layer |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for row in args.rows.split(","):
        config, generation, shape, rules, mesh = row.split(":")
        mesh = mesh.replace("/", ",")
        topology = f"{generation}:{shape}"
        chips = math.prod(int(d) for d in shape.split("x"))
        for backend, flags in (
            ("TPU", ["--topology", topology] + (["--over-hbm"] if args.over_hbm else [])),
            ("XLA:CPU", ["--host-devices", str(chips)]),
        ):
            if backend not in args.backends.split(","):
                continue
            r = dryrun(config, mesh, rules, args.set, flags, args.timeout)
            head = f"| {config} | {topology} | `{rules}` | {mesh} | {backend} |"
            if "error" in r:
                print(f"{head} {r['error'][:150]} |||||||||||", flush=True)
                continue
            b, est, ex = r["per_device_bytes"], r.get("chip_estimate"), r["explain"]
            ratio = (
                r["collective_volume_bytes"] / r["analytic_minimum_total"]
                if r["analytic_minimum_total"]
                else 0
            )
            unexplained = sum(u["volume_bytes"] for u in ex["unexplained"])
            # Gathers and reduce-scatters the compiler ran as all-reduces, counted as what they do.
            one_way = (
                (r["collective_volume_bytes"] - ex["as_all_reduce_excess_bytes"])
                / r["analytic_minimum_total"]
                if r["analytic_minimum_total"]
                else 0
            )
            kinds = {}
            for c in r["collectives"]:
                count, volume = kinds.get(c["kind"], (0, 0.0))
                kinds[c["kind"]] = (count + c["count"], volume + c["volume_bytes"])
            by_kind = "; ".join(f"{k} {n:,}, {gib(v)}" for k, (n, v) in sorted(kinds.items()))
            tail = f" {by_kind} | {r['kernel_calls_per_layer']:g} |"
            print(
                f"{head} {gib(b['peak'])}{'' if est['fits'] else ' (over)'} | {gib(est['hbm_per_device'])} | "
                f"{gib(r['collective_volume_bytes'])} | {ratio:.2f} | {one_way:.2f} | {gib(unexplained)} | "
                f"{est['step_s']:.3f} | {est['mfu']:.1%} | {r['compile_seconds']:.0f} |{tail}"
                if est
                else f"{head} {gib(b['peak'])} | - | {gib(r['collective_volume_bytes'])} | {ratio:.2f} | {one_way:.2f} | "
                f"{gib(unexplained)} | - | - | {r['compile_seconds']:.0f} |{tail}",
                flush=True,
            )


if __name__ == "__main__":
    main()
