"""Text <-> token ids: bytes, a Hugging Face `tokenizer.json` (the `tokenizers` library) or a
SentencePiece `.model` (`sentencepiece`), chosen by `data.tokenizer` (`bytes` or a path).

A run keeps its tokenizer file in its run dir (`tokenizer.json` or `tokenizer.model`, as
spmd-train and `spmd-ckpt import-hf` copy it there), so spmd-sample and spmd-eval encode and
decode with it; a run dir without one is byte-level (vocab_size 256, trained on text).
"""

import hashlib
import pathlib

import numpy as np

from spmd.core.errors import UserError

HF_TOKENIZER = "tokenizer.json"
SP_TOKENIZER = "tokenizer.model"
# Names an end-of-document token goes by, in the order they are looked for.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|im_end|>")


def file_hash(path: pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256
    eos_id = None  # every byte value is text; documents are kept apart by segment ids only
    sha256 = "bytes"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, the character index each token starts at)."""
        data = text.encode()
        char_of_byte = np.repeat(np.arange(len(text)), [len(c.encode()) for c in text])
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32), char_of_byte.astype(np.int64)

    def decode(self, ids) -> str:
        """The bytes as UTF-8 text; an id past 255 (a model with a larger vocabulary trained on
        bytes can still draw one) is no byte, and shows as U+FFFD."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        bad = (ids < 0) | (ids > 255)
        runs, start = [], 0
        for i in np.flatnonzero(bad):  # the bytes between ids that are no byte, each run decoded
            runs.append(bytes(ids[start:i].astype(np.uint8)).decode("utf-8", errors="replace"))
            start = i + 1
        runs.append(bytes(ids[start:].astype(np.uint8)).decode("utf-8", errors="replace"))
        return "\ufffd".join(runs)


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
        self.file = pathlib.Path(path)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.sha256 = file_hash(path)
        ids = [self.tokenizer.token_to_id(name) for name in EOS_NAMES]
        self.eos_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text).ids, np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encoded = self.tokenizer.encode_batch(texts)
        return [np.asarray(e.ids, np.int32) for e in encoded]

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, the character index each token starts at) of `text` with no special tokens added
        (a chat template writes its own)."""
        e = self.tokenizer.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, np.int32), np.asarray([start for start, _ in e.offsets], np.int64).reshape(
            -1
        )

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


class SentencePieceTokenizer:
    def __init__(self, path: pathlib.Path):
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise UserError(
                f"{path} is not a loadable SentencePiece model ({str(e).splitlines()[0][:200]})"
            ) from None
        self.name = str(path)
        self.file = pathlib.Path(path)
        self.vocab_size = self.sp.get_piece_size()
        self.sha256 = file_hash(path)
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.sp.encode(text), np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self.sp.encode(texts)]

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        raise UserError(
            f"chat data needs a tokenizer.json (or bytes), not the SentencePiece model {self.name}: use the "
            f"tokenizer.json the model ships beside it"
        )

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def load(spec: str):
    """`bytes`, or the path of a tokenizer.json or a SentencePiece .model (told apart by content:
    a tokenizer.json is JSON)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    if not path.is_file():
        raise UserError(
            f"tokenizer {spec!r} not found; give the path of a tokenizer.json or a SentencePiece .model, or 'bytes'"
        )
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return HFTokenizer(path) if head.startswith(b"{") else SentencePieceTokenizer(path)


def run_file_name(tokenizer) -> str | None:
    """The name a tokenizer's file takes in a run dir (None for bytes)."""
    if isinstance(tokenizer, HFTokenizer):
        return HF_TOKENIZER
    if isinstance(tokenizer, SentencePieceTokenizer):
        return SP_TOKENIZER
    return None


def for_run(run_dir: pathlib.Path, cfg, recorded: dict | None = None):
    """The tokenizer a run's text goes through (see the module docstring), or an error saying why
    there is none. `recorded`: what the run recorded of its tokenizer (config.json's and every
    checkpoint's `tokenizer`: name, sha256): a run on bytes is byte-level whatever its
    vocabulary's size, and a tokenizer file that is not the recorded one is refused."""
    if recorded is not None and recorded.get("name") == ByteTokenizer.name:
        return ByteTokenizer()
    for name, cls in ((HF_TOKENIZER, HFTokenizer), (SP_TOKENIZER, SentencePieceTokenizer)):
        path = run_dir / name
        if not path.is_file():
            continue
        tok = cls(path)
        if recorded is not None and recorded.get("sha256") not in (None, tok.sha256):
            raise UserError(
                f"{path} is not the tokenizer this run was trained with (sha256 {tok.sha256[:12]}..., the run "
                f"recorded {str(recorded['sha256'])[:12]}... for {recorded.get('name')}); put that one back"
            )
        if tok.vocab_size > cfg.model.vocab_size:
            raise UserError(
                f"{path} has {tok.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
                f"it is not this model's tokenizer"
            )
        return tok
    if recorded is not None:
        raise UserError(
            f"{run_dir} has no {HF_TOKENIZER} or {SP_TOKENIZER}, and the run was trained with the tokenizer "
            f"{recorded.get('name')}; put that file in the run directory"
        )
    if cfg.model.vocab_size != 256 or cfg.data.path.endswith((".npy", ".bin")):
        raise UserError(
            f"{run_dir} has no {HF_TOKENIZER} or {SP_TOKENIZER} and the run recorded none: its model "
            f"(vocab_size {cfg.model.vocab_size}, data {cfg.data.path or 'the embedded corpus'}) cannot be "
            f"taken for a byte-level one; put the tokenizer file it was trained with in the run directory"
        )
    return ByteTokenizer()


def record(tokenizer) -> dict:
    """What a run records of its tokenizer (config.json and every checkpoint's metadata)."""
    return {"name": tokenizer.name, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id}  # fmt: skip


def check_agrees(recorded: dict | None, data: dict | None, where: str, allow: bool = False) -> None:
    """The data's tokenizer is the one a checkpoint was trained with (token ids mean the same
    text), or an error naming both. Either side unknown (raw .npy/.bin ids, a checkpoint that
    recorded none) or `allow` (a deliberate swap): nothing to check."""
    if allow or not recorded or not data or recorded.get("sha256") == data.get("sha256"):
        return
    raise UserError(
        f"{where} was trained with the tokenizer {recorded.get('name')} (sha256 {str(recorded.get('sha256'))[:12]}), "
        f"but the data's is {data.get('name')} (sha256 {str(data.get('sha256'))[:12]}): its token ids mean other "
        f"text. Use data prepared with the run's tokenizer (data.path as the run had it), or pass "
        f"--allow-tokenizer-change for a deliberate swap"
    )
