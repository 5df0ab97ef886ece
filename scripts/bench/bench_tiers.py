"""What a lost process costs with storage checkpoints only, and with a local tier beside them.

    python scripts/bench/bench_tiers.py [--config small] [--steps 60] [--kills 27,37,57] [--rounds 2]

Runs one job under spmd-launch (2 processes on loopback, data across them) four ways, in rounds
(A B A B): storage checkpoints every `--every` steps, uninterrupted and with process 1 killed
(-9) before each step in `--kills` (the launcher restarts the job); then the same with a local
tier (`checkpoint.local_every`, a copy on the other process) whose directory the killed process
loses each time (a replaced host: its shards come back from the peer). The kills are injected by
tests/hang_train.py. For each way: the restores and the steps they redid (the run's
restores.jsonl), the seconds the restores took, the wall time, the wall time lost against the same
way uninterrupted (both include the launcher's back-off, 2, 4, 8 s before restarts 1, 2, 3); and
the local saves' blocking time per save. Prints a Markdown table of medians over rounds.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def job(args, work: pathlib.Path, tiered: bool, killed: bool) -> dict:
    from spmd.io.local_tier import base_dir
    from spmd.loop import goodput

    run_dir, local = work / "run", work / "local"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    train = [str(ROOT / "tests" / "hang_train.py"), "--config", args.config, "--dcn-mesh", "data=2", "--mesh",
             f"fsdp={args.devices}", "--host-devices", str(args.devices), "--steps", str(args.steps), "--log-every", "1",
             "--eval-every", "0", "--checkpoint-every", str(args.every), "--run-dir", str(run_dir),
             *[a for kv in args.set for a in ("--set", kv)]]  # fmt: skip
    if tiered:
        train += ["--set", f"checkpoint.local_dir={local}", "--set", f"checkpoint.local_every={args.local_every}",
                  "--set", "checkpoint.replicas=1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["HANG_MARK"] = str(work / "mark")
    if killed:
        env |= {"DIE_STEP": args.kills, "DIE_PROCESS": "1"}
        if tiered:
            env["DIE_WIPE"] = str(base_dir(str(local), run_dir) / "process-1")
    kills = len(args.kills.split(",")) if killed else 0
    cmd = [sys.executable, "-m", "spmd.cli.launch", "--processes", "2", "--host-devices", str(args.devices),
           "--max-restarts", str(kills), "--", sys.executable, *train]  # fmt: skip
    t0 = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        sys.exit(f"error: the job failed ({result.returncode}):\n{result.stderr[-3000:]}")
    restores = goodput.read_restores(run_dir)
    saves = re.search(r"local checkpoints: (\d+) saves, ([\d.]+)s blocking each", result.stderr)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "wall": wall,
        "restores": len(restores),
        "tiers": ",".join(sorted({r["tier"] for r in restores})),
        "redone": sum(r["steps_lost"] for r in restores),
        "restore_s": sum(r["seconds"] for r in restores),
        "local_save_s": float(saves.group(2)) if saves else None,
        "step_s": statistics.median(r["step_time"] for r in steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20, help="storage checkpoints every N steps")
    p.add_argument("--local-every", type=int, default=2)
    p.add_argument("--kills", default="27,37,57", help="process 1 dies before these steps (0-based)")
    p.add_argument(
        "--set",
        action="append",
        default=["train.global_batch_size=64"],
        help="config overrides for the job [train.global_batch_size=64: steps long enough to matter]",
    )
    p.add_argument("--devices", type=int, default=1, help="devices per process")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    ways = [(tiered, killed) for tiered in (False, True) for killed in (False, True)]
    runs = {w: [] for w in ways}
    work = pathlib.Path(tempfile.mkdtemp(prefix="spmd-bench-tiers-"))
    try:
        for _ in range(args.rounds):
            for w in ways:
                runs[w].append(job(args, work / "job", *w))
                print(w, runs[w][-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(w, key):
        values = [r[key] for r in runs[w] if r[key] is not None]
        return statistics.median(values) if values else None

    print(
        "| tiers | kills | restores (from) | steps redone | restore s | wall s | wall lost s | local save s | step s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for tiered, killed in ways:
        w = (tiered, killed)
        lost = [k["wall"] - u["wall"] for k, u in zip(runs[w], runs[(tiered, False)])] if killed else None
        save = med(w, "local_save_s")
        print(
            f"| {'storage + local' if tiered else 'storage only'} | {args.kills if killed else '-'} | "
            f"{runs[w][0]['restores']} ({runs[w][0]['tiers'] or '-'}) | {med(w, 'redone'):.0f} | {med(w, 'restore_s'):.2f} | "
            f"{med(w, 'wall'):.1f} | {statistics.median(lost) if lost else 0:.1f} | "
            f"{f'{save:.3f}' if save is not None else '-'} | {med(w, 'step_s'):.3f} |"
        )


if __name__ == "__main__":
    main()
