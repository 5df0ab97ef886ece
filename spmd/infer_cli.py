"""`spmd-eval` and `spmd-sample`: held-out loss and text from a run's checkpoints, on any mesh."""

import argparse
import codecs
import json
import pathlib
import sys

from spmd.cli import _exit_now, _log, _Parser, _set_host_devices


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run-dir", required=True, help="a training run directory (or a checkpoints dir, or one step)"
    )
    p.add_argument("--step", type=int, help="a committed step [latest]")
    p.add_argument("--mesh", default="fsdp=-1", help="mesh to load onto [fsdp=-1]")
    p.add_argument("--rules", help="sharding rules [the run's own]")
    p.add_argument("--host-devices", type=int, help="simulate N CPU devices")


def eval_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spmd-eval", description="Held-out loss, perplexity and bits per byte of a checkpoint.")
    _common(p)
    p.add_argument(
        "--data",
        help="evaluate on this data's held-out split instead of the run's (same formats as data.path)",
    )
    p.add_argument(
        "--batches", type=int, help="number of held-out batches [train.eval_batches, as logged in training]"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def sample_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spmd-sample", description="Generate text from a checkpoint with KV-cache decoding.")
    _common(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable: a batch)")
    p.add_argument("--prompts-file", help="a file with one prompt per line (a batch)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy [0.8]")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 = all [40]")
    p.add_argument("--seed", type=int, default=0)
    return p


def _run(parser, body, argv) -> int:
    args = parser.parse_args(argv)
    from spmd.errors import UserError, report

    try:
        if args.host_devices is not None:
            _set_host_devices(args.host_devices)
        return body(args)
    except UserError as e:
        report(e)
        return _exit_now(2)


def _eval(args) -> int:
    from spmd import inference
    from spmd.data import make_batches
    from spmd.errors import UserError

    if args.batches is not None and args.batches < 1:
        raise UserError(f"--batches must be positive, got {args.batches}")
    overrides = [f"data.path={args.data}"] if args.data else []
    loaded = inference.load(args.run_dir, args.step, args.mesh, args.rules, overrides)
    batches = make_batches(loaded.cfg, loaded.plan.batch_sharding)
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
    return 0


def _sample(args) -> int:
    from spmd import inference
    from spmd.errors import UserError

    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = no limit), got {args.top_k}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    texts = list(args.prompt or [])
    if args.prompts_file:
        path = pathlib.Path(args.prompts_file)
        if not path.is_file():
            raise UserError(f"prompts file {str(path)!r} not found")
        texts += [line for line in path.read_text().splitlines() if line]
    if not texts:
        raise UserError("give a --prompt or a --prompts-file")
    loaded = inference.load(args.run_dir, args.step, args.mesh, args.rules, batch=0, seq_len=1, decoding=True)
    prompts = [inference.encode(t, loaded.cfg) for t in texts]
    context = loaded.cfg.train.seq_len
    for text, p in zip(texts, prompts):
        if len(p) == 0:
            raise UserError("a prompt is empty; give at least one character")
        if len(p) > context:
            raise UserError(
                f"prompt {text[:30]!r}... is {len(p)} tokens, longer than the model's context of "
                f"{context} tokens (train.seq_len); shorten it"
            )
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    if longest > context:
        _log(
            f"warning: prompt + {args.max_new_tokens} new tokens reach position {longest}, past the {context} "
            f"positions the model was trained on"
        )
    sampler = inference.Sampler(loaded)
    if len(prompts) == 1:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(texts[0])
        sys.stdout.flush()

        def stream(t, tokens_B):
            sys.stdout.write(decoder.decode(bytes([int(tokens_B[0])])))
            sys.stdout.flush()

        sampler.generate(
            prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed, on_token=stream
        )
        sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    else:
        outs = sampler.generate(prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed)
        for i, (text, out) in enumerate(zip(texts, outs)):
            completion = bytes(out.astype("uint8")).decode("utf-8", errors="replace")
            print(f"=== sample {i} ===\n{text}{completion}")
    return 0


def eval_main(argv=None) -> int:
    return _run(eval_parser(), _eval, argv)


def sample_main(argv=None) -> int:
    return _run(sample_parser(), _sample, argv)
