"""`spmd-data prepare`: documents in, token shards out, for spmd-train's `data.path`.

Inputs are files or directories of `.txt` or `.md` (one document per file), `.jsonl` (one document per
line, in a text field) and `.parquet` (a text column). The output directory holds

  manifest.json            tokenizer (name, sha256, vocab size, EOS id), documents, tokens, shards
  train-00000.bin, ...     token ids, uint16 (vocab <= 65536) or uint32, documents back to back
  train-00000.idx, ...     int64 end offset of each document in its .bin (so document i is
                           bin[idx[i-1]:idx[i]])
  val-00000.bin/.idx       the held-out split: documents whose sha1 falls in the lowest val_fraction

Why .bin + .idx rather than ArrayRecord: training reads fixed windows that cross document
boundaries, which is one slice of a memory-mapped array here (no per-record decode, no copy),
and the document index is all packing needs. It is the layout Megatron and torchtitan's
preprocessed datasets use, and numpy is the only reader needed.

Each document ends with the tokenizer's EOS token when it has one (bytes has none: documents are
kept apart by segment ids only). Tokenization runs in worker processes; the output is written to
a temporary directory and renamed into place, and re-running with the same inputs, tokenizer and
options finds the same key in the manifest and does nothing.
"""

import collections
import contextlib
import dataclasses
import gc
import hashlib
import json
import multiprocessing
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Iterator

import numpy as np

from spmd.core.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "spmd-tokens-1"
SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
CHUNK = 256  # documents per task handed to a worker


@dataclasses.dataclass(frozen=True)
class Options:
    tokenizer: str = "bytes"
    text_field: str = "text"
    val_fraction: float = 0.0
    errors: str = "strict"  # how non-UTF-8 text is decoded: strict (an error) | replace
    shard_tokens: int = 1 << 30  # a new shard after this many tokens
    # chat data (spmd.data.chat): .jsonl records with a `messages` list, rendered with a chat template
    format: str = "text"  # text | chat | preference (spmd.data.preference: prompt/chosen/rejected rows)
    chat_template: str = ""  # a jinja file; empty: the tokenizer's own (tokenizer_config.json)
    train_on: str = "assistant"  # all | assistant | last
    seq_len: int = 0  # conversations (pairs) longer than this many tokens are `overlong` (0: no limit)
    overlong: str = "drop"  # chat: drop | split (across windows); preference: keep_end | keep_start | drop


CHAT_OPTIONS = ("chat_template", "train_on", "seq_len", "overlong")


def input_files(inputs: list[str], extensions: tuple[str, ...] = SUFFIXES) -> list[pathlib.Path]:
    """Every input file, directories expanded (sorted, recursively, the files whose suffix is one of
    `extensions`), in a fixed order. A file named on its own is read whatever its name (as text,
    unless it is .jsonl or .parquet)."""
    if not inputs:
        raise UserError("spmd-data prepare needs input files or directories")
    files = []
    for item in inputs:
        path = pathlib.Path(item).expanduser()
        if not path.exists():
            raise UserError(f"input {item!r} not found")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in extensions)
            if not found:
                raise UserError(
                    f"input directory {item!r} holds no {', '.join(extensions)} files; name other suffixes with --ext"
                )
            files += found
        else:
            files.append(path)
    return files


def _decode(data: bytes, path: pathlib.Path, errors: str, line: int | None = None) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        where = f"{path}" + (f" line {line}" if line else "")
        raise UserError(
            f"{where} is not UTF-8 text (byte {e.start}); fix the file, or pass --errors replace"
        ) from None


def documents(path: pathlib.Path, opts: Options) -> Iterator:
    """The documents of one input file, in order: texts, or (format chat) message lists."""
    if opts.format == "chat":
        yield from _conversations(path, opts)
    elif opts.format == "preference":
        yield from _pairs(path, opts)
    elif path.suffix not in (".jsonl", ".parquet"):  # .txt, .md, or any file named on its own: one document
        yield _decode(path.read_bytes(), path, opts.errors)
    elif path.suffix == ".jsonl":
        for n, record in _records(path, opts):
            text = record.get(opts.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(
                    f"{path} line {n} has no text field {opts.text_field!r}; name the field with --text-field"
                )
            yield text
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path} is not a readable parquet file ({e})") from None
        if opts.text_field not in table.schema_arrow.names:
            raise UserError(
                f"{path} has no column {opts.text_field!r} (columns: {', '.join(table.schema_arrow.names)}); "
                f"name it with --text-field"
            )
        for batch in table.iter_batches(columns=[opts.text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text


def _records(path: pathlib.Path, opts: Options) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-empty line of a .jsonl file."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(_decode(raw, path, opts.errors, n))
            except json.JSONDecodeError as e:
                raise UserError(f"{path} line {n} is not JSON ({e.msg})") from None


def _conversations(path: pathlib.Path, opts: Options) -> Iterator[list]:
    from spmd.data import chat

    if path.suffix != ".jsonl":
        raise UserError(
            f'input {str(path)!r}: chat data is .jsonl, one {{"messages": [...]}} object per line'
        )
    for n, record in _records(path, opts):
        messages = record.get("messages") if isinstance(record, dict) else None
        chat.check_messages(messages, f"{path} line {n}", opts.train_on)
        yield messages


def _pairs(path: pathlib.Path, opts: Options) -> Iterator[tuple]:
    from spmd.data import preference

    if path.suffix == ".jsonl":
        for n, record in _records(path, opts):
            yield preference.check_row(record, f"{path} line {n}")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path} is not a readable parquet file ({e})") from None
        columns = [c for c in ("prompt", "chosen", "rejected") if c in table.schema_arrow.names]
        row = 0
        for batch in table.iter_batches(columns=columns):
            for record in batch.to_pylist():
                row += 1
                yield preference.check_row(record, f"{path} row {row}")
    else:
        raise UserError(
            f"input {str(path)!r}: preference data is .jsonl or .parquet rows with prompt, chosen and rejected"
        )


# The end-of-document token of a tokenizer trained here (id 0): spmd-data prepare ends each
# document with it.
EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(inputs: list[str], out: str, vocab_size: int, opts: Options) -> dict:
    """Train a byte-level BPE tokenizer.json (Hugging Face `tokenizers`) on the documents of
    `inputs` (the files `prepare` reads, with the same --text-field and --errors), with EOS_TOKEN
    as id 0, and write it to `out` atomically. Returns {"vocab_size", "documents", "out"}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UserError(
            f"--vocab-size must be at least 257 (the 256 bytes and {EOS_TOKEN}), got {vocab_size}"
        )
    dest = pathlib.Path(out).expanduser()
    if dest.is_dir():
        raise UserError(f"--out {out!r} is a directory; give the path of the tokenizer.json to write")
    files = input_files(inputs)
    count = [0]

    def texts():
        for path in files:
            for text in documents(path, opts):
                count[0] += 1
                yield text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        tmp.replace(dest)
    except OSError as e:
        raise UserError(f"--out {out!r} cannot be written: {e.strerror}") from None
    return {"vocab_size": tok.get_vocab_size(), "documents": count[0], "out": str(dest)}


def in_val(text: str, val_fraction: float) -> bool:
    """The held-out split, by document content: stable under reordering and re-running."""
    digest = hashlib.sha1(text.encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def inputs_key(files: list[pathlib.Path], tokenizer, opts: Options) -> str:
    """What the output depends on: input contents, the tokenizer file, the options."""
    options = dataclasses.asdict(opts) | {"tokenizer": ""}
    if opts.format == "chat":  # the template is part of the output, wherever it comes from
        from spmd.data import chat

        options["chat_template"] = chat.ChatTemplate.load(tokenizer, opts.chat_template).source
    elif opts.format == "preference":  # conversations render with the template, strings end in its EOS
        from spmd.data import chat

        try:
            options["chat_template"] = chat.ChatTemplate.load(tokenizer, opts.chat_template).source
        except UserError:
            options["chat_template"] = ""
        options["special"] = chat.special_tokens(chat.tokenizer_config(tokenizer))
    else:  # keys of text data as they were before chat data existed
        options = {k: v for k, v in options.items() if k not in CHAT_OPTIONS and k != "format"}
    h = hashlib.sha256(json.dumps([FORMAT, tokenizer.sha256, options]).encode())
    for f in files:
        h.update(str(f).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


_worker_encode = None


def _init_worker(opts: Options) -> None:
    global _worker_encode
    # One thread per worker: the workers are the parallelism (the tokenizers library would
    # otherwise start a thread per core in every worker and oversubscribe the machine).
    os.environ["RAYON_NUM_THREADS"] = "1"
    from spmd.data import tokenizer as tokenizer_lib

    _worker_encode = encoder(tokenizer_lib.load(opts.tokenizer), opts)


def _encode(documents: list) -> list:
    return _worker_encode(documents)


def encoder(tokenizer, opts: Options):
    """documents -> [(token ids, loss mask or None, UTF-8 bytes of the text)]: texts end in the
    tokenizer's EOS where it has one; conversations are exactly what their template renders."""
    if opts.format == "preference":
        from spmd.data import preference

        encode_pair = preference.encoder(tokenizer, opts.chat_template)

        def encode(rows):
            return [(encode_pair(row), None, sum(_utf8_size(part) for part in row)) for row in rows]

        return encode
    if opts.format == "chat":
        from spmd.data import chat

        template = chat.ChatTemplate.load(tokenizer, opts.chat_template)

        def encode(conversations):
            out = []
            for messages in conversations:
                text, trained = chat.spans(template, messages, opts.train_on)
                ids, mask = chat.mask_tokens(tokenizer, text, trained)
                out.append((ids, mask, len(text.encode("utf-8", "surrogatepass"))))
            return out

        return encode
    eos = tokenizer.eos_id

    def encode(texts):
        out = []
        for text, ids in zip(texts, tokenizer.encode_batch(texts)):
            if eos is not None and (len(ids) == 0 or ids[-1] != eos):
                ids = np.append(ids, np.int32(eos))
            out.append((ids, None, len(text.encode("utf-8", "surrogatepass"))))
        return out

    return encode


def _utf8_size(part) -> int:
    """UTF-8 bytes of a string, or of a message list's contents."""
    if isinstance(part, str):
        return len(part.encode("utf-8", "surrogatepass"))
    return sum(len(str(m.get("content", "")).encode("utf-8", "surrogatepass")) for m in part)


def _chunks(files, opts) -> Iterator[list[str]]:
    chunk = []
    for f in files:
        for text in documents(f, opts):
            chunk.append(text)
            if len(chunk) == CHUNK:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


class _ShardWriter:
    """Documents of one split into <split>-NNNNN.bin/.idx files."""

    def __init__(self, directory: pathlib.Path, split: str, dtype, shard_tokens: int, masked: bool = False):
        self.directory, self.split, self.dtype, self.limit = directory, split, dtype, shard_tokens
        self.masked = masked  # chat data: a .mask file (uint8 per token) beside each .bin
        self.trained = 0  # tokens the masks train on
        self.shards: list[dict] = []
        self.documents = self.tokens = self.bytes = 0
        self._open()

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}"
        self.bin = open(self.directory / f"{name}.bin", "wb")
        self.bin_sha = hashlib.sha256()
        self.ends: list[int] = []
        self.shard = {"bin": f"{name}.bin", "idx": f"{name}.idx", "documents": 0, "tokens": 0}
        if self.masked:
            self.shard["mask"] = f"{name}.mask"
            self.mask = open(self.directory / self.shard["mask"], "wb")
            self.mask_sha = hashlib.sha256()
        self.shards.append(self.shard)

    def add(self, ids: np.ndarray, n_bytes: int = 0, mask: np.ndarray | None = None) -> None:
        """One document's token ids; `n_bytes`: its text's size in UTF-8 (for bits per byte);
        `mask`: which of its tokens are trained on (chat data)."""
        if self.shard["tokens"] and self.shard["tokens"] + len(ids) > self.limit:
            self._close()
            self._open()
        data = np.asarray(ids, self.dtype).tobytes()
        self.bin.write(data)
        self.bin_sha.update(data)
        if self.masked:
            flags = np.asarray(mask, np.uint8).tobytes()
            self.mask.write(flags)
            self.mask_sha.update(flags)
            self.trained += int(np.count_nonzero(mask))
        self.shard["tokens"] += len(ids)
        self.shard["documents"] += 1
        self.ends.append(self.shard["tokens"])
        self.documents, self.tokens = self.documents + 1, self.tokens + len(ids)
        self.bytes += n_bytes

    def _close(self) -> None:
        self.bin.close()
        ends = np.asarray(self.ends, np.int64)
        ends.tofile(self.directory / self.shard["idx"])
        self.shard["sha256"] = {
            "bin": self.bin_sha.hexdigest(),
            "idx": hashlib.sha256(ends.tobytes()).hexdigest(),
        }
        if self.masked:
            self.mask.close()
            self.shard["sha256"]["mask"] = self.mask_sha.hexdigest()

    def close(self) -> dict:
        self._close()
        if not self.shard["documents"] and len(self.shards) > 1:
            self.shards.pop()
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            **({"trained_tokens": self.trained} if self.masked else {}),
            "shards": self.shards,
        }


def prepare(inputs: list[str], out: str, opts: Options, workers: int = 1, overwrite: bool = False,
            progress: bool = True, extensions: tuple[str, ...] = SUFFIXES) -> dict:  # fmt: skip
    """Tokenize `inputs` into `out` (see the module doc); returns the manifest."""
    from spmd.data import tokenizer as tokenizer_lib

    if opts.errors not in ("strict", "replace"):
        raise UserError(f"--errors must be strict or replace, got {opts.errors!r}")
    if not 0 <= opts.val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1), got {opts.val_fraction}")
    from spmd.data.preference import OVERLONG

    if opts.format not in ("text", "chat", "preference"):
        raise UserError(f"--format must be text, chat or preference, got {opts.format!r}")
    if opts.format == "text" and opts.chat_template or opts.format != "chat" and opts.train_on != "assistant":
        raise UserError("--chat-template and --train-on are for chat data: add --format chat")
    if opts.format == "preference" and opts.overlong not in OVERLONG:
        raise UserError(
            f"--overlong for preference data must be {', '.join(OVERLONG)}, got {opts.overlong!r}"
        )
    if (
        opts.train_on not in ("all", "assistant", "last")
        or opts.format == "chat"
        and opts.overlong not in ("drop", "split")
    ):
        raise UserError("--train-on must be all, assistant or last, and --overlong drop or split")
    if opts.seq_len < 0:
        raise UserError(f"--seq-len must be >= 0 (0: no limit), got {opts.seq_len}")
    files = input_files(inputs, extensions)
    tokenizer = tokenizer_lib.load(opts.tokenizer)
    key = inputs_key(files, tokenizer, opts)
    out_dir = pathlib.Path(out).expanduser()
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out!r} cannot be created: {e.strerror}") from None
    with _out_lock(out_dir, out):
        _remove_stale_temporaries(out_dir)
        if out_dir.exists():
            existing = read_manifest(out_dir, check=False) if (out_dir / MANIFEST).is_file() else None
            if existing is not None and existing.get("key") == key:
                existing["unchanged"] = True
                return existing
            if not overwrite:
                what = "a different prepared dataset" if existing is not None else "other files"
                raise UserError(f"--out {out!r} already holds {what}; pass --overwrite or another --out")
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        tmp = parent / f".{out_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            try:
                manifest = _write(files, tmp, tokenizer, opts, dtype, workers, progress)
            except OSError as e:  # a full disk, a quota, a vanished directory
                raise UserError(
                    f"writing {out!r} failed ({e.strerror or e}); nothing was replaced: free space or choose "
                    f"another --out"
                ) from None
            if manifest["splits"]["train"]["documents"] == 0:
                raise UserError(
                    f"inputs {', '.join(inputs)} hold no documents (or all fell in the held-out split)"
                )
            manifest["key"] = key
            if opts.format == "chat":  # the template the data was rendered with, as transformers names it
                from spmd.data import chat

                (tmp / chat.TEMPLATE_FILE).write_text(
                    chat.ChatTemplate.load(tokenizer, opts.chat_template).source
                )
            name = tokenizer_lib.run_file_name(tokenizer)
            if name:  # the directory carries its tokenizer: spmd-train finds it there
                shutil.copy2(tokenizer.file, tmp / name)
            manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
            if out_dir.exists():
                if not overwrite:  # it appeared meanwhile (a writer that took no lock)
                    raise UserError(
                        f"--out {out!r} was written by something else while preparing; nothing replaced"
                    )
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _out_lock(out_dir: pathlib.Path, out: str):
    """One prepare per --out at a time: `.<name>.lock` beside it holds the writer's pid (a lock
    whose process is gone is taken over)."""
    lock = out_dir.parent / f".{out_dir.name}.lock"
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        except OSError as e:
            raise UserError(
                f"--out {out!r} cannot be written ({e.strerror}); choose a writable place"
            ) from None
        else:
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            break
        text = lock.read_text().strip() if lock.is_file() else ""
        if text.isdigit() and _pid_alive(int(text)):
            raise UserError(
                f"--out {out!r} is being written by another spmd-data prepare (pid {text}); wait for it "
                f"to finish (or, if no such process runs here, remove {lock})"
            ) from None
        lock.unlink(missing_ok=True)  # its process is gone
    else:
        raise UserError(
            f"could not take the lock {lock} for --out {out!r}; remove it if no prepare is running"
        )
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _remove_stale_temporaries(out_dir: pathlib.Path) -> None:
    """Temporary directories of prepares into the same --out that were killed."""
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _write(files, directory, tokenizer, opts: Options, dtype, workers: int, progress: bool) -> dict:
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from spmd.data import preference

    chat, pairs = opts.format == "chat", opts.format == "preference"
    writers = {
        s: _ShardWriter(directory, s, dtype, opts.shard_tokens, masked=chat or pairs)
        for s in ("train", "val")
    }
    eos = tokenizer.eos_id
    overlong = {"truncated": 0, "dropped": 0} if pairs else {"split": 0, "dropped": 0}
    n_pairs = {"train": 0, "val": 0}
    started = time.perf_counter()
    columns = [TextColumn("{task.fields[docs]:,} documents  {task.fields[toks]:,} tokens  "
                          "{task.fields[dps]:,.0f} documents/s  {task.fields[tps]:,.0f} tokens/s"), TimeElapsedColumn()]  # fmt: skip
    from rich.console import Console

    # transient: the line goes when the work ends (the command then says what it wrote, or one error line)
    bar = Progress(*columns, disable=not progress, transient=True, console=Console(stderr=True))
    task = bar.add_task("prepare", docs=0, toks=0, dps=0.0, tps=0.0, total=None)
    # Chunks go to the workers in order and come back in order; the texts wait here (for the
    # held-out split), at most `ahead` chunks in flight so memory stays bounded.
    pending, ahead = collections.deque(), threading.Semaphore(4 * max(workers, 1))

    def feed():
        for chunk in _chunks(files, opts):
            ahead.acquire()
            pending.append(chunk)
            yield chunk

    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(opts,))
        encoded_chunks = pool.imap(_encode, feed(), chunksize=1)
    else:
        encoded_chunks = map(encoder(tokenizer, opts), feed())
    try:
        with bar:
            for encoded in encoded_chunks:
                chunk = pending.popleft()
                ahead.release()
                for document, (ids, mask, n_bytes) in zip(chunk, encoded):
                    if pairs:  # ids: the two sequences of one pair, written together
                        pair, cut = preference.fit(ids, opts.seq_len, opts.overlong)
                        if pair is None:
                            overlong["dropped"] += 1
                            continue
                        overlong["truncated"] += cut
                        split = (
                            "val"
                            if in_val(
                                json.dumps(document, sort_keys=True, ensure_ascii=False), opts.val_fraction
                            )
                            else "train"
                        )
                        for sequence, completion in pair:
                            writers[split].add(sequence, n_bytes // 2, completion)
                        n_pairs[split] += 1
                        continue
                    if len(ids) == 0:
                        continue
                    if opts.seq_len and len(ids) > opts.seq_len:
                        overlong["dropped" if opts.overlong == "drop" else "split"] += 1
                        if opts.overlong == "drop":
                            continue
                    key = json.dumps(document, sort_keys=True, ensure_ascii=False) if chat else document
                    split = "val" if in_val(key, opts.val_fraction) else "train"
                    writers[split].add(ids, n_bytes, mask)
                docs = sum(w.documents for w in writers.values())
                toks = sum(w.tokens for w in writers.values())
                seconds = max(time.perf_counter() - started, 1e-9)
                bar.update(task, docs=docs, toks=toks, dps=docs / seconds, tps=toks / seconds)
    except UserError as e:
        # Raised by the pool's task thread reading the inputs, it carries that thread's frames,
        # which hold the pool's queues: without them the pool can be collected (below).
        raise e.with_traceback(None) from None
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
            # Its queues' semaphores are released when the pool is collected. Our commands end
            # with os._exit (spmd.cli.common.exit_now), which runs no finalizers: collected here, an
            # error's exit does not leave the resource tracker reporting them leaked.
            pool = encoded_chunks = None
            gc.collect()
    splits = {s: w.close() for s, w in writers.items()}
    return {
        "format": FORMAT,
        "tokenizer": {
            "name": tokenizer.name,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": eos,
        },  # fmt: skip
        "dtype": np.dtype(dtype).name,
        **({"chat": _chat_record(tokenizer, opts, overlong)} if chat else {}),
        **(
            {
                "preference": {
                    "pairs": n_pairs,
                    "seq_len": opts.seq_len,
                    "overlong": {"policy": opts.overlong, **overlong},
                }
            }
            if pairs
            else {}
        ),
        "documents": sum(s["documents"] for s in splits.values()),
        "tokens": sum(s["tokens"] for s in splits.values()),
        "splits": splits,
        "options": dataclasses.asdict(opts),
        "inputs": [str(f) for f in files],
        "seconds": round(time.perf_counter() - started, 3),
    }


def _chat_record(tokenizer, opts: Options, overlong: dict) -> dict:
    """What the manifest says of chat data: the template, what is trained on, and the conversations
    longer than --seq-len."""
    from spmd.data import chat

    template = chat.ChatTemplate.load(tokenizer, opts.chat_template)
    return {
        "template": template.origin,
        "template_sha256": hashlib.sha256(template.source.encode()).hexdigest(),
        "train_on": opts.train_on,
        "seq_len": opts.seq_len,
        "overlong": {"policy": opts.overlong, **overlong},
    }


def tokenizer_file(directory: pathlib.Path) -> pathlib.Path | None:
    """The copy of the tokenizer a prepared directory keeps (None for bytes)."""
    from spmd.data.tokenizer import HF_TOKENIZER, SP_TOKENIZER

    for name in (HF_TOKENIZER, SP_TOKENIZER):
        if (pathlib.Path(directory) / name).is_file():
            return pathlib.Path(directory) / name
    return None


MANIFEST_DIGEST = "manifest_sha256"  # the manifest's own digest: its counts are protected as its shards are


def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k not in (MANIFEST_DIGEST, "unchanged")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(directory: pathlib.Path, check: bool = True) -> dict:
    """A prepared directory's manifest; with `check`, its shards are verified against it (sizes,
    document counts), so a truncated or missing shard is an error before training starts."""
    path = pathlib.Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        assert manifest["format"] == FORMAT and {"train", "val"} <= set(manifest["splits"])
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise UserError(
            f"{path} is not a readable spmd-data manifest; prepare the directory again with spmd-data prepare"
        ) from None
    saved = manifest.get(MANIFEST_DIGEST)  # directories prepared before it existed have none
    if saved is not None and saved != manifest_digest(manifest):
        raise UserError(
            f"{path} does not match its own digest: its counts or records were edited or damaged; prepare the "
            f"directory again"
        )
    if check:
        verify(directory, manifest, cached=True)
    return manifest


def _file_sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def verify(directory: pathlib.Path, manifest: dict, cached: bool = False) -> list[str]:
    """Every shard of a prepared directory against its manifest: its size, and its sha256 where
    the manifest has one (directories prepared before digests existed: the names of the files
    that could not be checked are returned). An error names the first file that differs.
    `cached`: a file whose (path, size, mtime) was verified before is not read again (a cache in
    ~/.cache/spmd); what changed since, or a file touched by an edit, is hashed again."""
    from spmd.core.paths import cache_dir

    directory = pathlib.Path(directory)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    cache_path = cache_dir() / "verified-shards.json"
    seen = {}
    if cached and cache_path.is_file():
        with contextlib.suppress(OSError, ValueError):
            seen = json.loads(cache_path.read_text())
    unchecked, fresh = [], {}
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            kinds = [("bin", shard["tokens"] * itemsize), ("idx", shard["documents"] * 8)]
            if "mask" in shard:
                kinds.append(("mask", shard["tokens"]))
            for kind, want in kinds:
                f = directory / shard[kind]
                stat = f.stat() if f.is_file() else None
                if stat is None or stat.st_size != want:
                    raise UserError(
                        f"prepared data {str(directory)!r}: {shard[kind]} is "
                        f"{'missing' if stat is None else f'{stat.st_size:,} bytes'} but the manifest says "
                        f"{want:,}; it was truncated or replaced: prepare the directory again"
                    )
                digests = shard.get("sha256", {})
                if not isinstance(digests, dict):
                    raise UserError(
                        f"prepared data {str(directory)!r}: its manifest's sha256 entry for {shard[kind]} is not a "
                        f"table of digests: the manifest was edited or damaged; prepare the directory again"
                    )
                digest = digests.get(kind)
                if digest is None:
                    unchecked.append(shard[kind])
                    continue
                key = f"{f.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
                if seen.get(key) == digest:
                    continue
                if _file_sha256(f) != digest:
                    raise UserError(
                        f"prepared data {str(directory)!r}: {shard[kind]} does not match the sha256 in its "
                        f"manifest: its bytes were changed or damaged; prepare the directory again"
                    )
                fresh[key] = digest
    if cached and fresh:
        with contextlib.suppress(OSError):
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**seen, **fresh}))
            os.replace(tmp, cache_path)
    return unchecked
