"""Dry-run table: llama-8b on 8, 64 and 256 devices and llama-70b on 256, under fsdp and fsdp_tp;
mixtral-8x7b and deepseek-v2-lite under expert parallelism; llama-8b under the three context-parallel
modes.

    python scripts/bench_dryrun.py [--rows llama-8b:8,mixtral-8x7b:64:fsdp_ep:fsdp=8/expert=8,...]

A row `config:devices` runs fsdp and fsdp_tp on the standard meshes; `config:devices:rules:mesh`
(mesh with `/` between axes) runs exactly that.

Each row is one `spmd-dryrun --json` process on that many fake CPU devices (nothing allocated).
Prints per-device memory, bytes sent / analytic minimum, and compile time as a Markdown table.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESHES = {
    ("fsdp", 8): "fsdp=8",
    ("fsdp_tp", 8): "fsdp=4,tensor=2",
    ("fsdp", 64): "fsdp=64",
    ("fsdp_tp", 64): "fsdp=16,tensor=4",
    ("fsdp", 256): "fsdp=256",
    ("fsdp_tp", 256): "fsdp=64,tensor=4",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rows",
        default="llama-8b:8,llama-8b:64,llama-8b:256,llama-70b:256,"
        "mixtral-8x7b:64:ep:data=8/expert=8,mixtral-8x7b:64:fsdp_ep:fsdp=8/expert=8,"
        "mixtral-8x7b:256:fsdp_ep:fsdp=32/expert=8,deepseek-v2-lite:64:fsdp_ep:fsdp=8/expert=8,"
        "llama-8b:64:cp_ring:fsdp=16/context=4,llama-8b:64:cp_ulysses:fsdp=16/context=4,"
        "llama-8b:64:allgather:fsdp=16/context=4",
    )
    p.add_argument("--timeout", type=int, default=1200)
    args = p.parse_args()
    print(
        "| config | devices | rules | mesh | params+opt+grads / device | temporaries / device | sent / analytic min | compile (s) | wall (s) |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for row in args.rows.split(","):
        config, n, *explicit = row.split(":")
        cases = (
            [(explicit[0], explicit[1].replace("/", ","))]
            if explicit
            else [(rules, MESHES[(rules, int(n))]) for rules in ("fsdp", "fsdp_tp")]
        )
        for rules, mesh in cases:
            t = time.perf_counter()
            out = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "dryrun.py"),
                    "--config",
                    config,
                    "--mesh",
                    mesh,
                    "--rules",
                    rules,
                    "--host-devices",
                    n,
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
            wall = time.perf_counter() - t
            if out.returncode:
                print(
                    f"| {config} | {n} | {rules} | {mesh} | failed: {out.stderr.strip().splitlines()[-1][:80]} | | | | {wall:.0f} |"
                )
                continue
            r = json.loads(out.stdout)
            b = r["per_device_bytes"]
            static = (b["params"] + b["optimizer_state"] + b["gradients"]) / 2**30
            ratio = r["collective_volume_bytes"] / r["analytic_minimum_total"]
            print(
                f"| {config} | {n} | {rules} | {mesh} | {static:.2f} GiB | {b['temporaries'] / 2**30:,.1f} GiB | "
                f"{ratio:.2f} | {r['compile_seconds']:.1f} | {wall:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
