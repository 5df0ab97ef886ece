"""`spmd-sample`: text from a run's checkpoint with KV-cache decoding, on any mesh."""

import argparse
import math
import pathlib
import sys

from spmd.cli.common import Parser, add_checkpoint_flags, run_main
from spmd.core.errors import log


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="spmd-sample", description="Generate text from a checkpoint with KV-cache decoding.")
    add_checkpoint_flags(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable: a batch)")
    p.add_argument("--prompts-file", help="a file with one prompt per line (a batch)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy [0.8]")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 = all [40]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message: rendered with the run's chat template and answered as the "
        "assistant, up to the end of its turn",
    )
    p.add_argument("--system", default="", help="--chat: a system message first")
    p.add_argument("--chat-template", default="", help="--chat: a jinja template file [the run's own]")
    return p


def main(argv=None) -> int:
    # only a command run from its command line may relaunch itself (cpu.host_heap: tbbmalloc)
    return run_main(build_parser(), lambda args: run(args, may_relaunch=argv is None), argv)


def run(args, may_relaunch: bool = False) -> int:
    from spmd.assembly.setup import before_jax_starts

    # the host heap spmd-train runs with (cpu.host_heap's default): each step's temporaries reused,
    # not faulted in again
    before_jax_starts(None, may_relaunch=may_relaunch)
    from spmd.core.errors import UserError
    from spmd.io import inference

    if not math.isfinite(args.temperature) or args.temperature < 0:
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
        try:
            texts += [line for line in path.read_text(encoding="utf-8").splitlines() if line]
        except UnicodeDecodeError as e:
            raise UserError(
                f"prompts file {str(path)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8"
            ) from None
    if not texts:
        raise UserError("give a --prompt or a --prompts-file")
    from spmd.data import tokenizer as tokenizer_lib

    if (args.system or args.chat_template) and not args.chat:
        raise UserError("--system and --chat-template are for --chat")
    loaded = inference.load(args.run_dir, args.step, args.mesh, args.rules, args.set, batch=0, decoding=True)
    tokenizer = tokenizer_lib.for_run(loaded.run_dir, loaded.cfg, loaded.meta.get("run", {}).get("tokenizer"))
    stop = set()
    if args.chat:
        from spmd.data import chat

        template = chat.ChatTemplate.load(tokenizer, args.chat_template)
        system = [{"role": "system", "content": args.system}] if args.system else []
        rendered = [
            template.render([*system, {"role": "user", "content": t}], add_generation_prompt=True)
            for t in texts
        ]
        prompts = [tokenizer.encode_with_offsets(r)[0] for r in rendered]
        stop = chat.stop_ids(tokenizer, template)
        texts = [""] * len(texts)  # the reply alone is printed
    else:
        prompts = [tokenizer.encode(t) for t in texts]
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
        log(
            f"warning: prompt + {args.max_new_tokens} new tokens reach position {longest}, past the {context} "
            f"positions the model was trained on"
        )
    log(inference.compute_note(loaded))
    sampler = inference.Sampler(loaded)
    if len(prompts) == 1:
        sys.stdout.write(texts[0])
        sys.stdout.flush()
        new, shown = [], ""

        def stream(t, tokens_B):
            # Decode everything so far and print what is new: a character may span several tokens
            # (bytes of UTF-8, byte-fallback pieces); an incomplete one shows once it is whole.
            nonlocal shown
            if new and new[-1] in stop:
                return
            new.append(int(tokens_B[0]))
            text = completion(tokenizer, prompts[0], new)
            if not text.endswith("\ufffd") and text.startswith(shown):
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text

        sampler.generate(
            prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed, on_token=stream, stop=stop
        )
        text = completion(tokenizer, prompts[0], new)
        # A tokenizer whose decoding of a prefix is not a prefix of the whole: print it all again.
        sys.stdout.write((text[len(shown) :] if text.startswith(shown) else f"\n{texts[0]}{text}") + "\n")
    else:
        outs = sampler.generate(
            prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed, stop=stop
        )
        outs = [until_stop(out, stop) for out in outs]
        for i, (text, prompt, out) in enumerate(zip(texts, prompts, outs)):
            print(f"=== sample {i} ===\n{text}{completion(tokenizer, prompt, out)}")
    return 0


def until_stop(ids, stop: set[int]):
    """The tokens up to and including the first stop token."""
    for i, t in enumerate(ids):
        if int(t) in stop:
            return ids[: i + 1]
    return ids


def completion(tokenizer, prompt_ids, new_ids) -> str:
    """The text the new tokens add after the prompt: decoded together with the prompt, since a
    tokenizer may join or space tokens by context (as transformers' TextStreamer does)."""
    before = tokenizer.decode(prompt_ids)
    after = tokenizer.decode([*prompt_ids, *new_ids])
    return after[len(before) :] if after.startswith(before) else tokenizer.decode(new_ids)


if __name__ == "__main__":
    sys.exit(main())
