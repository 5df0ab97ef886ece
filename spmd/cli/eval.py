"""`spmd-eval`: held-out loss, perplexity and bits per byte of a run's checkpoint, on any mesh."""

import argparse
import json
import sys

from spmd.cli.common import Parser, add_checkpoint_flags, run_main


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="spmd-eval", description="Held-out loss, perplexity and bits per byte of a checkpoint.")
    add_checkpoint_flags(p)
    p.add_argument(
        "--data",
        help="evaluate on this data's held-out split instead of the run's (same formats as data.path)",
    )
    p.add_argument(
        "--batches", type=int, help="number of held-out batches [train.eval_batches, as logged in training]"
    )
    p.add_argument(
        "--allow-tokenizer-change",
        action="store_true",
        help="evaluate on --data prepared with another tokenizer than the run's (otherwise an error)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv=None) -> int:
    # only a command run from its command line may relaunch itself (cpu.host_heap: tbbmalloc)
    return run_main(build_parser(), lambda args: run(args, may_relaunch=argv is None), argv)


def run(args, may_relaunch: bool = False) -> int:
    from spmd.setup import before_jax_starts

    # the host heap spmd-train runs with (cpu.host_heap's default): each eval step's temporaries
    # reused, not faulted in again
    before_jax_starts(None, may_relaunch=may_relaunch)
    from spmd import inference
    from spmd.errors import UserError

    if args.batches is not None and args.batches < 1:
        raise UserError(f"--batches must be positive, got {args.batches}")
    overrides = list(args.set) + ([f"data.path={args.data}", "data.sources=[]"] if args.data else [])
    loaded = inference.load(args.run_dir, args.step, args.mesh, args.rules, overrides)
    if args.data:
        from spmd.data import data_tokenizer_record
        from spmd.tokenizer import check_agrees

        check_agrees(loaded.meta.get("run", {}).get("tokenizer"), data_tokenizer_record(loaded.cfg.data),
                     f"checkpoint {args.run_dir} (step {loaded.step})", args.allow_tokenizer_change)  # fmt: skip
    batches = loaded.setup.batches(held_out=True)
    distinct = max(1, batches.n_val_windows // batches.global_batch_size)
    if args.batches is not None and args.batches > distinct:
        raise UserError(
            f"--batches {args.batches} is more than the held-out split holds ({distinct} batches of "
            f"{batches.global_batch_size} x {batches.seq_len} tokens); ask for at most {distinct}"
        )
    result = inference.evaluate(loaded, batches, args.batches or loaded.cfg.train.eval_batches)
    result["data"] = batches.description
    if args.json:
        print(json.dumps(result))
    else:
        bpb = f", {result['bits_per_byte']:.4f} bits per byte" if result["bits_per_byte"] is not None else ""
        print(
            f"step {result['step']}: loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.3f}"
            f"{bpb} ({result['tokens']:,} held-out tokens in {result['batches']} batches; {result['data']})"
        )
        for name, loss in result.get("sources", {}).items():
            print(f"  source {name}: loss {loss:.4f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
