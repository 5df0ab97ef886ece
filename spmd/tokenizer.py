"""Text <-> token ids for a trained or imported run: the run dir's `tokenizer.json` (Hugging Face
`tokenizers`, as `spmd-ckpt import-hf` copies it) when it has one, else bytes for a byte-level
model (vocab_size 256, trained on text)."""

import pathlib

import numpy as np

from spmd.errors import UserError

HF_TOKENIZER = "tokenizer.json"


class ByteTokenizer:
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 — tokenizers raises a bare Exception for bad files
            raise UserError(
                f"{path} is not a loadable tokenizer.json ({str(e).splitlines()[0][:200]})"
            ) from None
        self.name = str(path)
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text).ids, np.int32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def for_run(run_dir: pathlib.Path, cfg):
    """The tokenizer a run's text goes through (see the module docstring), or an error saying why
    there is none."""
    path = run_dir / HF_TOKENIZER
    if path.is_file():
        tok = HFTokenizer(path)
        if tok.vocab_size > cfg.model.vocab_size:
            raise UserError(
                f"{path} has {tok.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
                f"it is not this model's tokenizer"
            )
        return tok
    if cfg.model.vocab_size != 256 or cfg.data.path.endswith((".npy", ".bin")):
        raise UserError(
            f"{run_dir} has no {HF_TOKENIZER} and the model is not byte-level (vocab_size 256, trained on "
            f"text), so text cannot be turned into its tokens; put the tokenizer.json it was trained with there"
        )
    return ByteTokenizer()
