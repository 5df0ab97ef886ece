"""Memory levers side by side: per-device memory and bytes sent of llama-8b on 64 and
llama-70b on 256 fake devices under dp, dp_zero1 and fsdp, for several optimizers, and the smallest
device count on which each fits a per-device budget according to the compiled step.

    python scripts/bench/bench_memory.py [--budget-gib 80] [--max-devices 512]

Everything is a dry-run (spmd.analysis.aot.dry_run: the train step compiled by XLA:CPU for fake
devices, nothing allocated), in one process holding `--max-devices` fake devices; each layout takes
the first n of them. The presets' global batch and remat stay as they are, so the activations
(temporaries) shrink as devices are added; the count searched is a power of two no larger than the
global batch (every layout here splits the batch over all devices). "Fits" means the compiled
peak (arguments + outputs - aliased + temporaries, less host-resident state) <= the budget.
"""

import argparse
import os
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-gib", type=float, default=80.0)
    p.add_argument("--max-devices", type=int, default=512)
    p.add_argument("--configs", default="llama-8b:64,llama-70b:256", help="config:devices of the first table")
    p.add_argument("--rules", default="dp,dp_zero1,fsdp")
    p.add_argument("--optimizers", default="adamw,adamw-bf16,adafactor,muon,adamw-offload")
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.max_devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

    import jax

    from spmd.analysis.aot import dry_run
    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    variants = {
        "adamw": [],
        "adamw-bf16": ["optimizer.state_dtype=bfloat16"],
        "adafactor": ["optimizer.name=adafactor"],
        "lion": ["optimizer.name=lion"],
        "muon": ["optimizer.name=muon"],
        "adamw-offload": ["optimizer.offload=true"],
    }
    budget = args.budget_gib * 2**30
    devices = jax.devices()
    gib = lambda n: f"{n / 2**30:,.2f}"  # noqa: E731
    cache = {}

    def measure(config, rules, opt, n):
        key = (config, rules, opt, n)
        if key not in cache:
            axis = "fsdp" if rules.startswith("fsdp") else "data"
            t = time.perf_counter()
            try:
                setup = assemble(config, f"{axis}={n}", rules, overrides=variants[opt], devices=devices[:n])
                cache[key] = dry_run(setup) | {"wall": time.perf_counter() - t}
            except UserError as e:
                cache[key] = {"error": str(e)}
        return cache[key]

    def fits(config, rules, opt, n) -> bool:
        r = measure(config, rules, opt, n)
        return "error" not in r and r["per_device_bytes"]["peak"] <= budget

    print(f"Per device, at the first table's device counts (budget {args.budget_gib:g} GiB):\n")
    print(
        "| config | devices | rules | optimizer | params | gradients | optimizer state (device) | host "
        "| temporaries | peak | sent per step | compile (s) |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for item in args.configs.split(","):
        config, n = item.split(":")
        for rules in args.rules.split(","):
            for opt in args.optimizers.split(","):
                r = measure(config, rules, opt, int(n))
                if "error" in r:
                    print(f"| {config} | {n} | {rules} | {opt} | error: {r['error'][:80]} |||||||")
                    continue
                b = r["per_device_bytes"]
                print(
                    f"| {config} | {n} | `{rules}` | {opt} | {gib(b['params'])} | {gib(b['gradients'])} | "
                    f"{gib(b['optimizer_state'] - b['host'])} | {gib(b['host'])} | {gib(b['temporaries'])} | "
                    f"{gib(b['peak'])} | {gib(r['collective_volume_bytes'])} | {r['compile_seconds']:.1f} |",
                    flush=True,
                )

    print(
        f"\nSmallest power-of-two device count whose compiled peak fits {args.budget_gib:g} GiB per device:\n"
    )
    print("| config | rules | optimizer | devices | peak there | peak at half as many |")
    print("|---|---|---|---:|---:|---:|")
    for item in args.configs.split(","):
        config, start = item.split(":")
        batch = assemble(
            config, "fsdp=1", "fsdp", devices=devices[:1], optimizer=False
        ).cfg.train.global_batch_size
        limit = min(args.max_devices, batch)
        for rules in args.rules.split(","):
            for opt in args.optimizers.split(","):
                # Peak falls as devices are added (the batch's activations split further): walk down
                # from the first table's count while it fits, else up until it does.
                n = int(start)
                if fits(config, rules, opt, n):
                    while n > 1 and fits(config, rules, opt, n // 2):
                        n //= 2
                else:
                    while n < limit and not fits(config, rules, opt, n):
                        n *= 2
                peak = lambda n: gib(measure(config, rules, opt, n)["per_device_bytes"]["peak"]) + " GiB"  # noqa: E731
                if fits(config, rules, opt, n):
                    below = peak(n // 2) if n > 1 else "-"
                    print(f"| {config} | `{rules}` | {opt} | **{n}** | {peak(n)} | {below} |", flush=True)
                else:
                    print(
                        f"| {config} | `{rules}` | {opt} | none up to {limit} | {peak(n)} at {n} | |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
