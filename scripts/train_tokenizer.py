"""Train a byte-level BPE tokenizer.json on your own text with the Hugging Face `tokenizers`
library, for `spmd-data prepare --tokenizer` (the README's "Train on your own text").

    python scripts/train_tokenizer.py docs README.md --vocab-size 512 --out runs/tok/tokenizer.json

Inputs are plain-text files or directories (searched recursively for .txt and .md).
`<|endoftext|>` is added as the end-of-document token (id 0).
"""

import argparse
import pathlib
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="text files or directories")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--out", required=True, help="where tokenizer.json goes")
    args = p.parse_args(argv)
    files = []
    for item in map(pathlib.Path, args.inputs):
        if item.is_dir():
            files += sorted(f for f in item.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
        elif item.is_file():
            files.append(item)
        else:
            print(f"error: input {str(item)!r} not found", file=sys.stderr)
            return 2
    if not files:
        print("error: no .txt or .md files among the inputs", file=sys.stderr)
        return 2
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    print(f"wrote {out}: {tok.get_vocab_size()} tokens from {len(files)} files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
