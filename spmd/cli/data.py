"""`spmd-data`: `prepare` tokenizes documents into shards that spmd-train reads through
`data.path`; `train-tokenizer` trains a BPE tokenizer for it on the same documents (spmd.data.prepare)."""

import argparse
import os
import sys

from spmd.cli.common import Parser, run_main
from spmd.core.errors import log

EPILOG = """
examples:
  spmd-data train-tokenizer corpus/ --vocab-size 8192 --out data/tokenizer.json
  spmd-data prepare corpus/ --tokenizer data/tokenizer.json --out data/corpus --val-fraction 0.01
  spmd-data prepare a.jsonl b.parquet --text-field content --tokenizer sp.model --out data/mix-a --workers 4
  spmd-train --config tiny --set data.path=data/corpus --set data.packing=segments ...
  spmd-data prepare chats.jsonl --format chat --tokenizer runs/llama/tokenizer.json --seq-len 2048 --out data/sft
  spmd-data prepare pairs.jsonl --format preference --tokenizer runs/sft/tokenizer.json --seq-len 1024 --out data/dpo
"""


def prepare_suffixes() -> tuple[str, ...]:
    from spmd.data.prepare import SUFFIXES

    return SUFFIXES


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="spmd-data", description="Data preparation for spmd-train.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    prep = sub.add_parser(
        "prepare",
        help="tokenize .txt/.md/.jsonl/.parquet documents into token shards and a manifest",
        description="Tokenize documents (.txt, .md or any named file: one per file; .jsonl: one per line; .parquet: one per row) "
        "into .bin/.idx token shards and manifest.json, atomically; rerunning on the same inputs is a no-op.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = prep.add_argument
    add(
        "inputs",
        nargs="+",
        help="files (any name: text unless .jsonl or .parquet) or directories (searched recursively for --ext)",
    )
    add(
        "--ext",
        default=",".join(prepare_suffixes()),
        help="the suffixes read in directories, comma-separated [.txt,.md,.jsonl,.parquet]",
    )
    add("--out", required=True, help="output directory")
    add("--tokenizer", default="bytes", help="'bytes', a tokenizer.json or a SentencePiece .model [bytes]")
    add("--text-field", default="text", help="the text field of .jsonl records / column of .parquet [text]")
    add(
        "--val-fraction",
        type=float,
        default=0.01,
        help="share of documents held out for evaluation, chosen by content hash [0.01]",
    )
    add("--workers", type=int, default=min(4, os.cpu_count() or 1), help="tokenizer processes [min(4, CPUs)]")
    add(
        "--errors",
        default="strict",
        choices=("strict", "replace"),
        help="non-UTF-8 text: an error, or replaced [strict]",
    )
    add("--shard-tokens", type=int, default=1 << 30, help="tokens per shard file [2^30]")
    add(
        "--format",
        default="text",
        choices=("text", "chat", "preference"),
        help="text documents; chat: .jsonl records with a 'messages' list of {role, content}; preference: "
        ".jsonl/.parquet rows with prompt, chosen and rejected (strings or message lists) [text]",
    )
    add("--chat-template", default="", help="chat: a jinja template file [the tokenizer's own chat_template]")
    add(
        "--train-on",
        default="assistant",
        choices=("all", "assistant", "last"),
        help="chat: the tokens trained on: every one, the assistant turns, the last assistant turn [assistant]",
    )
    add(
        "--seq-len",
        type=int,
        default=0,
        help="chat, preference: conversations (a pair's sequences) longer than this many tokens are overlong [0: none]",
    )
    add(
        "--overlong",
        default=None,
        choices=("drop", "split", "keep_end", "keep_start"),
        help="chat: drop overlong conversations, or split them across windows as text is [drop]; preference: "
        "keep each sequence's last (keep_end: the prompt is cut first) or first --seq-len tokens, or drop the "
        "pair [keep_end]",
    )
    add("--overwrite", action="store_true", help="replace an --out that holds a different prepared dataset")
    add("--quiet", action="store_true", help="no progress display")
    tok = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer.json on the documents prepare would read",
        description="Train a byte-level BPE tokenizer (Hugging Face tokenizers) on .txt/.md/.jsonl/.parquet "
        "documents, with <|endoftext|> as id 0, for spmd-data prepare --tokenizer.",
    )
    tok.add_argument("inputs", nargs="+", help="files or directories (as for prepare)")
    tok.add_argument("--vocab-size", type=int, default=8192, help="tokens, the 256 bytes included [8192]")
    tok.add_argument("--out", required=True, help="the tokenizer.json to write")
    tok.add_argument(
        "--text-field", default="text", help="the text field of .jsonl / column of .parquet [text]"
    )
    tok.add_argument(
        "--errors", default="strict", choices=("strict", "replace"), help="non-UTF-8 text [strict]"
    )
    ver = sub.add_parser(
        "verify",
        help="check every shard of a prepared directory against its manifest (sizes and sha256)",
        description="Read every shard of a prepared directory and check it against manifest.json: "
        "sizes, and the sha256 of each .bin and .idx (directories prepared before digests existed: "
        "sizes only, and says so).",
    )
    ver.add_argument("directory", help="a directory spmd-data prepare wrote")
    return p  # fmt: skip


def main(argv=None) -> int:
    return run_main(build_parser(), run, argv)


def run(args) -> int:
    from spmd.core.errors import UserError
    from spmd.data import prepare

    if args.command == "train-tokenizer":
        opts = prepare.Options(text_field=args.text_field, errors=args.errors)
        done = prepare.train_tokenizer(args.inputs, args.out, args.vocab_size, opts)
        log(f"wrote {done['out']}: {done['vocab_size']:,} tokens, trained on {done['documents']:,} documents")
        return 0

    if args.command == "verify":
        import pathlib

        directory = pathlib.Path(args.directory)
        if not (directory / prepare.MANIFEST).is_file():
            raise UserError(f"{str(directory)!r} has no {prepare.MANIFEST}: it is not a prepared directory")
        manifest = prepare.read_manifest(directory, check=False)
        unchecked = prepare.verify(directory, manifest)
        shards = sum(len(manifest["splits"][s]["shards"]) for s in ("train", "val"))
        if unchecked:
            print(f"sizes ok: {directory}: {shards} shards; no sha256 in the manifest for {len(unchecked)} files "
                  f"(prepared before digests existed): their bytes were not checked; prepare again to add them")  # fmt: skip
        else:
            print(f"ok: {directory}: {shards} shards, {manifest['tokens']:,} tokens read and checked")
        return 0

    if args.workers < 1 or args.shard_tokens < 1:
        raise UserError("--workers and --shard-tokens must be positive")
    opts = prepare.Options(
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        errors=args.errors,
        shard_tokens=args.shard_tokens,
        format=args.format,
        chat_template=args.chat_template,
        train_on=args.train_on,
        seq_len=args.seq_len,
        overlong=args.overlong or ("keep_end" if args.format == "preference" else "drop"),
    )
    extensions = tuple(
        e if e.startswith(".") else f".{e}" for e in (x.strip() for x in args.ext.split(",")) if e
    )
    if not extensions:
        raise UserError(f"--ext {args.ext!r} names no suffix; e.g. --ext .txt,.md")
    m = prepare.prepare(args.inputs, args.out, opts, args.workers, args.overwrite, progress=not args.quiet,
                        extensions=extensions)  # fmt: skip
    train, val = m["splits"]["train"], m["splits"]["val"]
    verb = "unchanged (same inputs, tokenizer and options)" if m.get("unchanged") else "wrote"
    if not val["documents"]:
        log(
            f"warning: no document was held out (--val-fraction {args.val_fraction} of {train['documents']:,}): "
            f"evaluation needs held-out documents; prepare with a larger --val-fraction, or train with --eval-every 0"
        )
    log(
        f"{verb} {args.out}: {train['documents']:,} training documents ({train['tokens']:,} tokens), "
        f"{val['documents']:,} held out ({val['tokens']:,} tokens); tokenizer {m['tokenizer']['name']} "
        f"(vocab {m['tokenizer']['vocab_size']:,}, eos {m['tokenizer']['eos_id']})"
    )
    if "preference" in m:
        pref, over = m["preference"], m["preference"]["overlong"]
        log(
            f"preference: {pref['pairs']['train']:,} training pairs, {pref['pairs']['val']:,} held out; longer than "
            f"--seq-len {pref['seq_len']}: {over['truncated']} truncated ({over['policy']}), {over['dropped']} dropped"
        )
    if "chat" in m:
        chat, over = m["chat"], m["chat"]["overlong"]
        log(
            f"chat: template {chat['template']}; trained on {chat['train_on']}: {train['trained_tokens']:,} of "
            f"{train['tokens']:,} training tokens; longer than --seq-len {chat['seq_len']}: {over['dropped']} dropped, "
            f"{over['split']} split"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
