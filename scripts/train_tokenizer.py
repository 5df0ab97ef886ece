"""`python scripts/train_tokenizer.py ...` is `spmd-data train-tokenizer ...` without installing the
entry point."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from spmd.cli.data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train-tokenizer", *sys.argv[1:]]))
