"""`spmd-eval`: held-out loss, perplexity and bits per byte of a run's checkpoint, on any mesh; with
`--tasks`, lm-eval benchmarks through spmd.io.harness."""

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
    p.add_argument(
        "--write-reference",
        action="store_true",
        help="write this checkpoint's log-probabilities of every completion in --data (prepared preference pairs) "
        "beside it, for DPO runs that start from it with preference.reference=precomputed",
    )
    bench = p.add_argument_group("benchmarks (lm-eval: pip install 'spmd-stack[lmeval]')")
    bench.add_argument("--tasks", help="comma-separated lm-eval tasks or groups, e.g. hellaswag,arc_easy")
    bench.add_argument("--limit", type=float, help="at most this many documents per task (a fraction if < 1)")
    bench.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt [the task's own]")
    bench.add_argument("--include-path", help="a folder of task YAML files besides lm-eval's own")
    bench.add_argument("--batch-size", type=int, default=8, help="requests per forward pass [8]")
    bench.add_argument(
        "--network-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the Hugging Face Hub when a task's data is not cached [10]",
    )
    return p


def main(argv=None) -> int:
    # only a command run from its command line may relaunch itself (cpu.host_heap: tbbmalloc)
    return run_main(build_parser(), lambda args: run(args, may_relaunch=argv is None), argv)


def run(args, may_relaunch: bool = False) -> int:
    from spmd.assembly.setup import before_jax_starts

    # the host heap spmd-train runs with (cpu.host_heap's default): each eval step's temporaries
    # reused, not faulted in again
    before_jax_starts(None, may_relaunch=may_relaunch)
    from spmd.core.errors import UserError
    from spmd.io import inference

    if args.tasks:
        return benchmarks(args)
    if args.batches is not None and args.batches < 1:
        raise UserError(f"--batches must be positive, got {args.batches}")
    overrides = list(args.set) + ([f"data.path={args.data}", "data.sources=[]"] if args.data else [])
    if args.write_reference:
        if not args.data:
            raise UserError("--write-reference needs --data: the prepared preference pairs to score")
        loaded = inference.load(args.run_dir, args.step, args.mesh, args.rules, overrides)
        record = inference.write_reference(loaded, args.data)
        print(f"wrote the reference log-probabilities of {record['checkpoint']} for {record['sequences']['train']:,} "
              f"training and {record['sequences']['val']:,} held-out sequences beside {args.data}")  # fmt: skip
        return 0
    loaded = inference.load(args.run_dir, args.step, args.mesh, args.rules, overrides, objective=True)
    from spmd.data.loader import data_tokenizer_record
    from spmd.data.tokenizer import check_agrees

    recorded, data = loaded.meta.get("run", {}).get("tokenizer"), data_tokenizer_record(loaded.cfg.data)
    if not args.data and recorded and data and recorded.get("sha256") != data.get("sha256"):
        raise UserError(
            f"{args.run_dir} uses the tokenizer {recorded.get('name')}, but the data it records "
            f"({loaded.cfg.data.path or 'none: the built-in byte corpus'}) is tokenized otherwise; pass --data DIR "
            f"prepared with its tokenizer (spmd-data prepare FILES --tokenizer {args.run_dir}/tokenizer.json --out DIR)"
        )
    check_agrees(
        recorded, data, f"checkpoint {args.run_dir} (step {loaded.step})", args.allow_tokenizer_change
    )
    batches = loaded.setup.batches(held_out=True)
    distinct = max(1, batches.n_val_windows // batches.global_batch_size)
    if args.batches is not None and args.batches > distinct:
        raise UserError(
            f"--batches {args.batches} is more than the held-out split holds ({distinct} batches of "
            f"{batches.global_batch_size} x {batches.seq_len} tokens); ask for at most {distinct}"
        )
    # the run's train.eval_batches, but never a batch twice: a smaller held-out split is scored once, and said
    args.batches = args.batches or min(loaded.cfg.train.eval_batches, distinct)
    notes = [inference.compute_note(loaded)]
    if args.batches < loaded.cfg.train.eval_batches:
        notes.append(f"the held-out split holds {distinct} distinct batch(es), fewer than train.eval_batches = "
                     f"{loaded.cfg.train.eval_batches}: each scored once")  # fmt: skip
    if loaded.cfg.train.objective != "lm":
        return preference(args, loaded, batches, notes)
    result = inference.evaluate(loaded, batches, args.batches)
    result["data"] = batches.description
    result["window"] = f"{batches.global_batch_size} x {batches.seq_len}"
    result["notes"] = notes
    if args.json:
        print(json.dumps(result))
    else:
        bpb = f", {result['bits_per_byte']:.4f} bits per byte" if result["bits_per_byte"] is not None else ""
        print(
            f"step {result['step']}: loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.3f}"
            f"{bpb} ({result['tokens']:,} held-out tokens in {result['batches']} batches of {result['window']} "
            f"tokens; {result['data']}; {'; '.join(notes)})"
        )
        for name, loss in result.get("sources", {}).items():
            print(f"  source {name}: loss {loss:.4f} nats/token")
    return 0


def preference(args, loaded, batches, notes) -> int:
    """A preference run (train.objective dpo, simpo, orpo): its loss and pair metrics on held-out pairs."""
    from spmd.io import inference

    result = inference.evaluate_preference(loaded, batches, args.batches)
    result["data"] = batches.description
    result["notes"] = notes
    if args.json:
        print(json.dumps(result))
        return 0
    against = " against the reference" if result["objective"] == "dpo" else ""
    print(
        f"step {result['step']}: {result['objective']} loss {result['loss']:.4f}, reward accuracy "
        f"{result['rewards/accuracies']:.3f}, reward margin {result['rewards/margins']:.4f}{against}; log-probabilities "
        f"chosen {result['logps/chosen']:.3f}, rejected {result['logps/rejected']:.3f} ({result['pairs']:,} held-out pairs, "
        f"{result['tokens']:,} completion tokens in {result['batches']} batches; {result['data']}; {'; '.join(notes)})"
    )
    return 0


def benchmarks(args) -> int:
    """--tasks: lm-eval's evaluator on the run (spmd.io.harness)."""
    from spmd.core.errors import UserError

    if args.data or args.batches is not None:
        raise UserError("--tasks evaluates benchmarks, not held-out data: drop --data and --batches")
    if args.limit is not None and args.limit <= 0 or args.batch_size < 1:
        raise UserError("--limit and --batch-size must be positive")
    if not 0 < args.network_timeout < float("inf"):
        raise UserError(f"--network-timeout must be a positive number of seconds, got {args.network_timeout}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError(
            f"--tasks {args.tasks!r} names no task; give lm-eval task names, e.g. --tasks hellaswag,arc_easy"
        )
    import os

    # a task whose data is not cached waits this long for the Hub, not minutes of retries
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        os.environ.setdefault(name, str(max(1, round(args.network_timeout))))  # whole seconds: what it parses
    try:
        from spmd.io import harness
    except ImportError:
        raise UserError("--tasks needs lm-eval: pip install 'spmd-stack[lmeval]'") from None
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    where = {"run_dir": args.run_dir, "step": args.step, "mesh": args.mesh, "rules": args.rules,
             "overrides": tuple(args.set)}  # fmt: skip
    try:
        results = harness.evaluate(where, tasks, limit, args.num_fewshot, args.include_path, args.batch_size)
    except OSError as e:  # the network (requests' and urllib3's errors are OSErrors), a full cache disk
        raise UserError(
            f"lm-eval could not load the data of --tasks {','.join(tasks)} ({type(e).__name__}: {str(e)[:200]}); "
            f"download it while online (it is cached under HF_HOME), or set HF_DATASETS_OFFLINE=1 with the data cached"
        ) from None
    if args.json:
        print(
            json.dumps(
                {"results": results["results"], "n-samples": results.get("n-samples", {})}, default=str
            )
        )
    else:
        from lm_eval.utils import make_table

        print(make_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
