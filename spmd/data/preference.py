"""Preference pairs as training data: `spmd-data prepare --format preference`.

Each input row has a `prompt` and two completions, `chosen` and `rejected`, as strings or as
conversations (the prompt a list of messages, each completion a list of the messages that follow
it, rendered with the tokenizer's own chat template). A row is tokenized as TRL's DPOTrainer
tokenizes it, so the same data gives the same token ids:

- strings: the tokenizer's end-of-text token (tokenizer_config.json's eos_token) is appended to
  each completion that does not end with it; the prompt, prompt + chosen and prompt + rejected
  are tokenized as the tokenizer tokenizes text (its post-processor adds BOS where it has one);
- conversations: the prompt rendered with the generation prompt, and the prompt followed by each
  completion, tokenized without added special tokens (the template writes them);
- the completion starts where the prompt's tokens and the whole sequence's first differ (the
  shorter of the two pairs' common prefix), so a token that merges across the boundary belongs to
  the completion.

Stored as two documents per pair, back to back in the same split (prompt + chosen, then prompt +
rejected), each with a loss mask that marks its completion (the chat data's .mask files:
spmd.data.chat). A pair whose longer sequence has more than `--seq-len` tokens is `overlong`:
`keep_end` keeps each sequence's last seq_len tokens (the prompt is cut first: TRL's
truncation_mode = "keep_end"), `keep_start` its first seq_len (dropped where the prompt alone fills
them, as TRL drops it), `drop` drops the pair; the manifest counts each.

Training reads pair i as rows 2i and 2i + 1 of a batch (`PairSource`), each padded to the window.
"""

import numpy as np

from spmd.core.errors import UserError

OVERLONG = ("keep_end", "keep_start", "drop")
# The rows of a preference batch, each (2 x pairs, T): PairSource's rows, in this order; with
# precomputed reference log-probabilities, REFERENCE_FIELD beside them, one float32 per row.
FIELDS = ("inputs", "targets", "loss_mask", "target_mask")
REFERENCE_FIELD = "reference_logps"
# The objectives scored against a reference model (spmd.training.preference), whose
# log-probabilities may come with the data.
REFERENCED = ("dpo",)


def precomputed_reference(cfg) -> bool:
    """Whether a run's batches carry the reference model's log-probabilities (run config `cfg`)."""
    return cfg.train.objective in REFERENCED and cfg.preference.reference == "precomputed"


def check_row(record, where: str) -> tuple[object, object, object]:
    """(prompt, chosen, rejected) of one input row, as strings or conversations; anything else
    is an error naming the row."""
    from spmd.data import chat

    if not isinstance(record, dict):
        raise UserError(f"{where}: a preference row must be an object with prompt, chosen and rejected")
    missing = [k for k in ("chosen", "rejected") if record.get(k) is None]
    if missing:
        raise UserError(
            f"{where}: no {' or '.join(repr(k) for k in missing)}: a preference row needs 'prompt', 'chosen' and "
            f"'rejected' (strings, or lists of {{role, content}} messages)"
        )
    chosen, rejected = record["chosen"], record["rejected"]
    conversational = isinstance(chosen, list)
    prompt = record.get("prompt") or ([] if conversational else "")
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if (
            conversational
            and not isinstance(value, list)
            or not conversational
            and not isinstance(value, str)
        ):
            raise UserError(
                f"{where}: {name!r} is a {type(value).__name__} but 'chosen' is a {type(chosen).__name__}: a row's "
                f"prompt and completions are all strings or all message lists"
            )
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or conversational and not any(m.get("content") for m in value if isinstance(m, dict)):
            raise UserError(f"{where}: {name!r} is empty; a preference pair needs two completions")
    if conversational:
        if prompt:
            chat.check_messages(prompt, f"{where} (prompt)", "all")
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            chat.check_messages(value, f"{where} ({name})", "all")
    if chosen == rejected:
        raise UserError(
            f"{where}: 'chosen' and 'rejected' are the same completion, which teaches nothing; drop the row"
        )
    return prompt, chosen, rejected


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def encoder(tokenizer, chat_template: str = ""):
    """row -> ((ids, completion mask) of prompt + chosen, the same of prompt + rejected)."""
    from spmd.data import chat

    template = None
    eos_text = chat.special_tokens(chat.tokenizer_config(tokenizer)).get("eos_token")

    def encode_text(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text), np.int32)

    def encode(row):
        nonlocal template
        prompt, chosen, rejected = row
        if isinstance(chosen, list):
            if template is None:
                template = chat.ChatTemplate.load(tokenizer, chat_template)
            prompt_ids = tokenizer.encode_with_offsets(template.render(prompt, add_generation_prompt=True))[0]
            full = [tokenizer.encode_with_offsets(template.render(prompt + c))[0] for c in (chosen, rejected)]
        else:
            if eos_text:
                chosen, rejected = (c if c.endswith(eos_text) else c + eos_text for c in (chosen, rejected))
            prompt_ids = encode_text(prompt)
            full = [encode_text(prompt + c) for c in (chosen, rejected)]
        start = min(_common_prefix(prompt_ids, f) for f in full)
        out = []
        for ids in full:
            mask = np.zeros(len(ids), np.uint8)
            mask[start:] = 1
            out.append((np.asarray(ids, np.int32), mask))
        return tuple(out)

    return encode


def fit(pair, seq_len: int, policy: str):
    """(the pair within `seq_len` tokens per sequence or None (dropped), whether it was cut)."""
    if not seq_len or max(len(ids) for ids, _ in pair) <= seq_len:
        return pair, False
    if policy == "drop":
        return None, False
    cut = slice(-seq_len, None) if policy == "keep_end" else slice(None, seq_len)
    kept = tuple((ids[cut], mask[cut]) for ids, mask in pair)
    if any(not mask.any() for _, mask in kept):  # the prompt alone fills the window
        return None, False
    return kept, True


class PairSource:
    """Pair i of a prepared preference split (documents 2i and 2i + 1) as a (2, 4, T) array: for
    prompt + chosen and prompt + rejected, the rows inputs, targets, loss_mask (the completion's
    targets) and target_mask (every real target), padded to `seq_len` (FIELDS)."""

    def __init__(self, stream, seq_len: int, what: str, reference=None):
        self.stream, self.seq_len = stream, seq_len
        # precomputed reference log-probabilities, one per sequence: a fifth row, its float32 bits
        # in the first column (spmd.data.loader.Batches takes them out as `reference_logps`)
        self.reference = reference
        if reference is not None and len(reference) != len(stream.doc_ends):
            raise UserError(
                f"{what}'s reference log-probabilities hold {len(reference)} sequences, the data {len(stream.doc_ends)}: "
                f"they were written for other data; write them again with --write-reference"
            )
        ends = stream.doc_ends
        if len(ends) % 2:
            raise UserError(
                f"{what} holds an odd number of sequences: it is not whole preference pairs; prepare it again"
            )
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.ends = ends.astype(np.int64)
        self.n = len(ends) // 2
        longest = int(np.max(self.ends - self.starts)) if len(ends) else 0
        if longest - 1 > seq_len:
            raise UserError(
                f"{what} holds a sequence of {longest} tokens, which needs train.seq_len >= {longest - 1}; raise "
                f"train.seq_len, or prepare the data with --seq-len {seq_len + 1}"
            )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        T = self.seq_len
        out = np.zeros((2, 4 if self.reference is None else 5, T), np.int32)
        for half in range(2):
            doc = 2 * int(i) + half
            lo, hi = int(self.starts[doc]), int(self.ends[doc])
            ids = np.asarray(self.stream[lo:hi], np.int32)
            mask = self.stream.mask(slice(lo, hi))
            n = len(ids) - 1
            out[half, 0, :n], out[half, 1, :n] = ids[:-1], ids[1:]
            out[half, 2, :n], out[half, 3, :n] = mask[1:], 1
            if self.reference is not None:
                out[half, 4, 0] = np.float32(self.reference[doc]).view(np.int32)
        return out


# Reference log-probabilities written beside prepared pairs (preference.reference = precomputed):
# reference.json says which checkpoint computed them; reference-<split>.npy holds one float32 per
# sequence (two per pair, in the order of the documents).
REFERENCE = "reference.json"


def reference_file(directory, split: str):
    import pathlib

    return pathlib.Path(directory) / f"reference-{split}.npy"


def read_reference(directory, what: str) -> tuple[dict, dict]:
    """(the record of reference.json, {split: float32 log-probabilities per sequence})."""
    import json
    import pathlib

    path = pathlib.Path(directory) / REFERENCE
    if not path.is_file():
        raise UserError(
            f"preference.reference = precomputed needs the reference model's log-probabilities beside {what}; "
            f"write them with spmd-eval --run-dir REFERENCE_RUN --data {directory} --write-reference (the run "
            f"--init-from names), or set preference.reference=checkpoint"
        )
    try:
        record = json.loads(path.read_text())
        found = {split: np.load(reference_file(directory, split)) for split in ("train", "val")}
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path} or its arrays cannot be read ({e}); write them again with --write-reference"
        ) from None
    return record, found


def write_reference(directory, record: dict, logps: dict) -> None:
    """Write reference.json and the arrays atomically (the record last: it is what readers look for)."""
    import json
    import os
    import pathlib

    directory = pathlib.Path(directory)
    for split, values in logps.items():
        final = reference_file(directory, split)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(values, np.float32))
        os.replace(tmp, final)
    tmp = directory / f".{REFERENCE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, directory / REFERENCE)
