"""The loss's memory on an accelerator, compiled not run: the train step with optax's
cross-entropy on float32 logits against spmd.training.loss's (no float32 copy of the logits), for a TPU
topology through libtpu on this host.

    python scripts/bench/bench_loss.py [--config llama-1b] [--topology v5p:2x2x1] [--shapes 8x2048,4x8192]

Prints a Markdown table of the compiled step's temporaries and peak per device (global batch x
sequence length over the topology's chips, rules fsdp, remat none).
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-1b")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--shapes", default="8x2048,4x8192", help="global batch x sequence length, per row")
    args = p.parse_args()

    from spmd.analysis import topology
    from spmd.analysis.aot import peak_bytes
    from spmd.assembly.setup import assemble
    from spmd.parallel.sharding import fmt_bytes

    devices = topology.devices(args.topology)
    print(f"{args.config} on {args.topology} ({len(devices)} chips), rules fsdp, remat none, bf16 compute\n")
    print("| global batch x T | loss | temporaries | peak |")
    print("|---|---|---:|---:|")
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        sets = [f"train.seq_len={T}", f"train.global_batch_size={B}", "model.remat=none"]
        setup = assemble(args.config, f"fsdp={len(devices)}", "fsdp", overrides=sets, devices=devices)
        for fused in (False, True):
            trainer = setup.with_choices(fused_loss=fused).trainer
            compiled = trainer.train_step.lower(
                trainer.abstract_state, trainer.abstract_batch(B, T)
            ).compile()
            mem = compiled.memory_analysis()
            name = "spmd.training.loss (bf16 logits kept)" if fused else "optax on float32 logits"
            print(f"| {B} x {T} | {name} | {fmt_bytes(mem.temp_size_in_bytes)} | {fmt_bytes(peak_bytes(mem))} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
