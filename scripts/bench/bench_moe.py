"""MoE benchmark: `small-moe` against dense `small` (same active parameters per token) on CPU, and
per-device expert-parameter bytes under expert parallelism.

    python scripts/bench/bench_moe.py [--steps 10]

Throughput: each case runs in its own process (scripts/bench/bench_train.py's worker); tokens/s from the
median step after warm-up; MFU counts active-parameter FLOPs (k experts per token, not E) over the
measured bf16 matmul peak of this machine. Bytes: from the sharding plan (nothing allocated).
"""

import argparse
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from bench_train import run_json  # noqa: E402

CASES = [  # (label, config, devices, mesh, rules, --set)
    ("small (dense), 1 device", "small", 1, "", "dp", []),
    ("small-moe capacity, 1 device", "small-moe", 1, "", "dp", []),
    ("small-moe dropless, 1 device", "small-moe", 1, "", "dp", ["moe.dispatch=dropless"]),
    ("small (dense), 8 dev data=8", "small", 8, "data=8", "dp", []),
    ("small-moe capacity, 8 dev expert=8", "small-moe", 8, "expert=8", "ep", []),
    ("small-moe dropless, 8 dev expert=8", "small-moe", 8, "expert=8", "ep", ["moe.dispatch=dropless"]),
]


def expert_bytes(config: str, mesh_spec: str, rules: str, devices: int) -> tuple[int, int]:
    import jax

    from spmd.assembly.setup import assemble

    plan = assemble(config, mesh_spec, rules, devices=jax.devices()[:devices], optimizer=False).plan
    experts = [p for p in plan.params if p.logical[:2] == ("layers", "expert")]
    total = sum(math.prod(p.shape) * p.dtype.itemsize for p in experts)
    local = sum(math.prod(p.local_shape) * p.dtype.itemsize for p in experts)
    return total, local


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 64)
    from spmd.loop.metrics import measure_matmul_flops
    from spmd.parallel.sharding import fmt_bytes

    peak = measure_matmul_flops("bfloat16")
    print(f"measured bf16 matmul peak: {peak / 1e9:.0f} GFLOP/s\n")
    print("| case | tokens/s | active FLOPs/token | MFU | vs dense |\n|---|---:|---:|---:|---:|")
    dense = {}
    for label, config, devices, mesh, rules, sets in CASES:
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "bench" / "bench_train.py"),
            "--worker",
            "--config",
            config,
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
        ] + [a for s in sets for a in ("--set", s)]
        r = run_json(cmd)
        if config == "small":
            dense[devices] = r["tokens_per_sec"]
        print(
            f"| {label} | {r['tokens_per_sec']:,.0f} | {r['flops_per_token'] / 1e6:.1f} M | "
            f"{r['tokens_per_sec'] * r['flops_per_token'] / peak:.1%} | {r['tokens_per_sec'] / dense[devices]:.2f}x |",
            flush=True,
        )

    print(
        "\n| config | mesh | expert params, total | per device | per device / (total/8) |\n|---|---|---:|---:|---:|"
    )
    for config, mesh, rules, devices in (
        ("small-moe", "expert=8", "ep", 8),
        ("mixtral-8x7b", "fsdp=8,expert=8", "fsdp_ep", 64),
        ("mixtral-8x7b", "data=8,expert=8", "ep", 64),
    ):
        total, local = expert_bytes(config, mesh, rules, devices)
        print(f"| {config} | {mesh} | {fmt_bytes(total)} | {fmt_bytes(local)} | {local / (total / 8):.3f} |")


if __name__ == "__main__":
    main()
