"""Data: token streams, fixed-length windows, and global batches that are a pure function of the step.

The batch for optimizer step `s` holds the windows at positions `s*B .. s*B+B-1` of a grain
`MapDataset` that is shuffled with the run's seed and reshuffled every epoch. Nothing but the
step (and the samples consumed, should the global batch size change on resume) is needed to find
the next batch, so the data position survives a restart on any number of devices or processes.

Each process reads only the rows of the global batch that its devices hold, and the batch is
assembled with `jax.make_array_from_process_local_data`.

Packing (`data.packing`): `concat` cuts the token stream into windows that run across document
boundaries; `segments` (prepared directories, which know where documents end) cuts the same
windows but tells the model where each document starts: segment ids (attention stays within a
document), positions that restart at each document, and a loss mask that leaves out predicting
a document's first token from the one before (and, for chat data, every token its own mask
leaves out: spmd.data.chat). Documents are packed back to back and split at window edges, so nothing
is padded. Window i is still a pure function of (seed, i).
"""

import dataclasses
import functools
import hashlib
import os
import pathlib
import sys
import sysconfig
import zlib

import grain
import jax
import numpy as np

from spmd.core.errors import UserError
from spmd.core.paths import cache_dir
from spmd.data.preference import precomputed_reference


def _atomic_save(path: pathlib.Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _stdlib_sources(root: pathlib.Path) -> list[str]:
    """Relative posix paths of the *.py files under `root` outside site-packages/dist-packages,
    sorted. (os.walk: every run lists them for the cache key, and pathlib's rglob took 0.4 s of
    each process's start for the 1,740 files of Python 3.12's.)"""
    names = []
    for directory, subdirs, filenames in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
        rel = pathlib.Path(directory).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        names += [prefix + f for f in filenames if f.endswith(".py")]
    return sorted(names)


def stdlib_corpus(val_fraction: float) -> tuple[pathlib.Path, pathlib.Path]:
    """Byte tokens of this Python's standard library source (*.py), split by file.

    Files are read in sorted order of their relative path; a file goes to the held-out split when
    crc32(relative path) falls in the lowest `val_fraction` of the range. Built once, then cached.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = _stdlib_sources(root)
    files = [root / name for name in names]
    listing = "\n".join(names)
    key = hashlib.sha1(f"{sys.version}|{root}|{val_fraction}|{listing}".encode()).hexdigest()[:12]
    out = cache_dir() / f"stdlib-{key}"
    train_path, val_path = out / "train.npy", out / "val.npy"
    if train_path.exists() and val_path.exists():
        return train_path, val_path
    if not files:
        raise UserError(
            f"no Python source files under {root} to build the default corpus; pass --set data.path=FILE"
        )
    parts = {"train": [], "val": []}
    for f in files:
        rel = f.relative_to(root).as_posix()
        split = "val" if zlib.crc32(rel.encode()) < val_fraction * 2**32 else "train"
        parts[split].append(f.read_bytes())
    out.mkdir(parents=True, exist_ok=True)
    for split, path in (("train", train_path), ("val", val_path)):
        _atomic_save(path, np.frombuffer(b"".join(parts[split]), dtype=np.uint8))
    return train_path, val_path


class TokenStream:
    """A prepared split's shards as one 1-D token sequence (memory-mapped; slices may cross
    shards), with the end offset of every document."""

    def __init__(self, directory: pathlib.Path, manifest: dict, split: str):
        dtype = np.dtype(manifest["dtype"])
        shards = manifest["splits"][split]["shards"]
        self.parts, ends, offset = [], [], 0
        # chat data (spmd.data.chat): 1 for each token trained on as a target, in .mask files
        self.masks = [] if all("mask" in shard for shard in shards) and shards else None
        for shard in shards:
            if shard["tokens"]:
                self.parts.append(np.memmap(directory / shard["bin"], dtype=dtype, mode="r"))
                ends.append(np.fromfile(directory / shard["idx"], dtype=np.int64) + offset)
                offset += shard["tokens"]
                if self.masks is not None:
                    self.masks.append(np.memmap(directory / shard["mask"], dtype=np.uint8, mode="r"))
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.doc_ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        self.dtype = dtype
        self.paired = "preference" in manifest  # documents 2i, 2i + 1: a preference pair

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        return self._slice(self.parts, index)

    def mask(self, index: slice) -> np.ndarray | None:
        """The loss mask of tokens `index` (None: every token is trained on)."""
        return None if self.masks is None else self._slice(self.masks, index)

    def _slice(self, parts: list, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(len(self))
        pieces = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            part_stop = min(stop, int(self.starts[k + 1]))
            pieces.append(parts[k][start - self.starts[k] : part_stop - self.starts[k]])
            start, k = part_stop, k + 1
        return np.concatenate(pieces) if len(pieces) != 1 else np.asarray(pieces[0])


def _read_text(path: pathlib.Path) -> np.ndarray:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def prepared_dir(data_cfg) -> pathlib.Path | None:
    """data.path (or a mixture's first source) when it is a directory spmd-data prepare wrote,
    else None."""
    from spmd.data.prepare import MANIFEST

    given = data_cfg.sources[0].path if data_cfg.sources else data_cfg.path
    path = pathlib.Path(given).expanduser() if given else None
    return path if path is not None and (path / MANIFEST).is_file() else None


def data_tokenizer_record(data_cfg) -> dict | None:
    """What the data's tokenizer is (spmd.data.tokenizer.record), or None where the data does not say:
    raw token ids (.npy, .bin) carry no tokenizer."""
    from spmd.data import tokenizer as tokenizer_lib

    path = data_cfg.sources[0].path if data_cfg.sources else data_cfg.path
    raw = data_cfg.format in ("npy", "bin") or (data_cfg.format == "auto" and path.endswith((".npy", ".bin")))
    if prepared_dir(data_cfg) is None and raw:
        return None
    return tokenizer_lib.record(data_tokenizer(data_cfg))


def data_tokenizer(data_cfg):
    """The tokenizer of the run's data: data.tokenizer when set, else the prepared directory's own
    (spmd-data prepare keeps a copy), else bytes; a data.tokenizer that is not the one the data
    was prepared with is an error."""
    from spmd.data import tokenizer as tokenizer_lib
    from spmd.data.prepare import read_manifest, tokenizer_file

    directory = prepared_dir(data_cfg)
    if directory is None:
        if data_cfg.tokenizer not in ("", "bytes"):
            raise UserError(
                f"data.tokenizer = {data_cfg.tokenizer!r} needs prepared data: run spmd-data prepare "
                f"<files> --tokenizer {data_cfg.tokenizer} --out DIR and set data.path=DIR"
            )
        return tokenizer_lib.ByteTokenizer()
    manifest = read_manifest(directory, check=False)
    for src in data_cfg.sources[1:]:
        other = pathlib.Path(src.path).expanduser()
        theirs = read_manifest(other, check=False) if (other / "manifest.json").is_file() else None
        if theirs is None or theirs["tokenizer"]["sha256"] != manifest["tokenizer"]["sha256"]:
            raise UserError(
                f"data.sources {src.label!r} was not prepared with the tokenizer of {str(directory)!r} "
                f"({manifest['tokenizer']['name']}); every source of a mixture needs the same tokenizer"
            )
    own = tokenizer_file(directory)
    tok = tokenizer_lib.load(data_cfg.tokenizer or (str(own) if own else "bytes"))
    if tok.sha256 != manifest["tokenizer"]["sha256"]:
        raise UserError(
            f"data.tokenizer {tok.name} is not the tokenizer {str(directory)!r} was prepared with "
            f"({manifest['tokenizer']['name']}); leave data.tokenizer empty to use that one"
        )
    return tok


def load_tokens(
    data_cfg, vocab_size: int, held_out: bool = True
) -> tuple[np.ndarray, np.ndarray, str, float | None]:
    """(train tokens, held-out tokens, a description, the held-out text's UTF-8 bytes per token or
    None where unknown) as 1-D integer sequences (memory-mapped when possible; TokenStreams, which
    know the documents, for a prepared directory). `held_out`: whether the held-out split is
    needed (evaluation); without it, prepared data may have none."""
    directory = prepared_dir(data_cfg)
    if directory is not None:
        from spmd.data.prepare import read_manifest

        manifest = read_manifest(directory)
        tok = manifest["tokenizer"]
        if tok["vocab_size"] > vocab_size:
            raise UserError(
                f"prepared data {str(directory)!r} uses a tokenizer of {tok['vocab_size']:,} tokens but the "
                f"model's vocabulary has {vocab_size:,}: prepare the data with the model's own tokenizer "
                f"(or, for a new run, raise model.vocab_size to at least {tok['vocab_size']:,})"
            )
        train, val = TokenStream(directory, manifest, "train"), TokenStream(directory, manifest, "val")
        if not len(val) and held_out:
            raise UserError(
                f"prepared data {str(directory)!r} has no held-out documents, which evaluation needs; prepare it "
                f"again with a larger --val-fraction (or more documents), or train with --eval-every 0"
            )
        desc = (
            f"{directory} (prepared: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens, "
            f"tokenizer {tok['name']})"
        )
        held_out = manifest["splits"]["val"]
        bytes_per_token = held_out["bytes"] / held_out["tokens"] if held_out.get("bytes") else None
        if val.masks is not None:  # the loss counts only trained tokens: no known bytes per token
            bytes_per_token = None
        return train, val, desc, bytes_per_token
    bytes_per_token = None  # token ids of unknown text (.npy, .bin)
    if not data_cfg.path:
        train_path, val_path = stdlib_corpus(data_cfg.val_fraction)
        train, val = np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r")
        desc = f"embedded corpus: Python {sys.version.split()[0]} standard library source, bytes ({train_path.parent})"
        bytes_per_token = 1.0
    else:
        path = pathlib.Path(data_cfg.path).expanduser()
        if not path.exists():
            raise UserError(
                f"data file {str(path)!r} not found; fix data.path, or leave it empty for the embedded corpus"
            )
        if path.is_dir() and any(path.glob("train-*.bin")):
            raise UserError(
                f"data directory {str(path)!r} holds token shards (train-*.bin) but no manifest.json: it is an "
                f"unfinished or damaged spmd-data prepare output, not text; prepare it again"
            )
        fmt = data_cfg.format
        if fmt == "auto":
            fmt = {".npy": "npy", ".bin": "bin"}.get(path.suffix, "text")
        if fmt == "npy":
            try:
                tokens = np.load(path, mmap_mode="r")
            except (ValueError, EOFError, OSError) as e:
                raise UserError(f"data file {str(path)!r} is not a readable .npy array: {e}") from None
            if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
                raise UserError(
                    f"data file {str(path)!r} must hold a 1-D integer array of token ids, got {tokens.dtype}{list(tokens.shape)}"
                )
        elif fmt == "bin":
            if path.stat().st_size % np.dtype(data_cfg.bin_dtype).itemsize:
                raise UserError(
                    f"data file {str(path)!r} size is not a multiple of {data_cfg.bin_dtype}; set data.bin_dtype"
                )
            tokens = (
                np.memmap(path, dtype=data_cfg.bin_dtype, mode="r")
                if path.stat().st_size
                else np.zeros(0, np.uint16)
            )
        else:
            tokens = _read_text(path)
            bytes_per_token = 1.0
        if tokens.size == 0:
            raise UserError(
                f"data {str(path)!r} is empty; point data.path at a file or directory with content"
            )
        n_val = max(1, int(len(tokens) * data_cfg.val_fraction))
        train, val = tokens[:-n_val], tokens[-n_val:]
        desc = f"{str(path)} ({fmt}, {len(tokens):,} tokens)"
    mask = data_cfg.mask_token_id
    head = np.asarray(train[: min(len(train), 1 << 20)])
    if mask >= 0 and head.size and not np.any(head[1:] != mask):  # targets are tokens 1..
        raise UserError(
            f"data.mask_token_id = {mask} masks every target in the first {head.size:,} tokens: the loss "
            f"would count nothing (NaN); use another id, or -1 for none"
        )
    smallest = int(min(train.min(initial=0), val.min(initial=0)))
    if smallest < 0:
        raise UserError(f"data holds the negative token id {smallest}; token ids start at 0")
    biggest = int(max(train.max(initial=0), val.max(initial=0)))
    if biggest >= vocab_size:
        raise UserError(
            f"data holds token id {biggest} but model.vocab_size is {vocab_size}; raise model.vocab_size"
        )
    return train, val, desc, bytes_per_token


class WindowSource:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = max(0, len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


class PackedWindowSource:
    """The windows of WindowSource with their documents marked (data.packing = segments): each
    item is a (5, seq_len) array of inputs, targets, segment ids, positions and loss mask (see
    the module doc); PACKED_FIELDS names the rows."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.n = max(0, len(stream) - 1) // seq_len
        self.doc_starts = np.concatenate([[0], stream.doc_ends[:-1]])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        T = self.seq_len
        start = int(i) * T
        window = np.asarray(self.stream[start : start + T + 1], dtype=np.int32)
        index = np.arange(start, start + T + 1)
        doc = np.searchsorted(self.stream.doc_ends, index, side="right")  # document of each token
        segment = (doc - doc[0]).astype(np.int32)
        position = (index - np.maximum(self.doc_starts[doc], start)).astype(np.int32)
        trained = (doc[1:] == doc[:-1]).astype(np.int32)  # the target continues the input's document
        mask = self.stream.mask(slice(start + 1, start + T + 1))
        if mask is not None:  # chat data: only the tokens its mask trains on
            trained &= mask.astype(np.int32)
        return np.stack([window[:-1], window[1:], segment[:-1], position[:-1], trained])


PACKED_FIELDS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass
class Batches:
    """Global batches for training (shuffled) and evaluation (in order) as sharded jax Arrays."""

    train: grain.MapDataset
    val: grain.MapDataset
    global_batch_size: int
    seq_len: int
    sharding: jax.sharding.NamedSharding  # for (batch, seq) arrays
    description: str
    n_train_windows: int
    n_val_windows: int
    # The data position: batch `start_step` begins at sample `start_sample` of the shuffled order.
    # A fresh run starts at (0, 0); a resumed one at the checkpoint's (step, consumed_samples), so
    # a new global batch size continues the sample stream where the old one stopped.
    start_step: int = 0
    start_sample: int = 0
    # A mixture's held-out split of each source, by name (eval_loss/<name>); empty otherwise.
    val_sources: dict = dataclasses.field(default_factory=dict)
    # UTF-8 bytes of held-out text per token (bits per byte), where the data says; None otherwise.
    val_bytes_per_token: float | None = None
    # rows of a batch per sample: 2 for preference pairs (spmd.data.preference), whose two
    # sequences are adjacent rows; global_batch_size and the data position count samples
    rows_per_sample: int = 1

    def resume_at(self, step: int, consumed_samples: int) -> None:
        self.start_step, self.start_sample = step, consumed_samples

    def consumed_samples(self, step: int) -> int:
        """Samples drawn by the batches before `step`."""
        return self.start_sample + (step - self.start_step) * self.global_batch_size

    @functools.cached_property
    def local_rows(self) -> list[int]:
        """Rows of the global batch held by this process's devices, in order: a contiguous range,
        or several blocks where the batch axes split rows over processes innermost (a pipeline's
        stages across processes: `stage` is the batch's last axis)."""
        n_rows = self.global_batch_size * self.rows_per_sample
        index_map = self.sharding.addressable_devices_indices_map((n_rows, self.seq_len))
        held = set()
        for idx in index_map.values():
            held.update(range(*idx[0].indices(n_rows)))
        return sorted(held)

    def _assemble(self, dataset, first: int) -> dict[str, jax.Array]:
        rows, k = self.local_rows, self.rows_per_sample
        shape = (self.global_batch_size * k, self.seq_len)
        if k > 1:  # pairs: (samples, 2, field, T) -> (rows, field, T), then this process's rows
            if rows != list(range(rows[0], rows[-1] + 1)):
                raise UserError(
                    "preference pairs need each process's rows of the batch in one block; the batch "
                    "axes split them over processes innermost (a pipeline's stages across "
                    "processes): put `stage` in --mesh, not --dcn-mesh"
                )
            rows = range(rows[0], rows[-1] + 1)
            lo, hi = rows.start // k, -(-rows.stop // k)
            windows = np.stack([dataset[first + i] for i in range(lo, hi)])
            windows = windows.reshape(-1, *windows.shape[2:])[rows.start - lo * k : rows.stop - lo * k]
            from spmd.data.preference import FIELDS, REFERENCE_FIELD

            out = {
                name: jax.make_array_from_process_local_data(self.sharding, windows[:, j], shape)
                for j, name in enumerate(FIELDS)
            }
            if windows.shape[1] > len(FIELDS):  # precomputed reference log-probabilities, per row
                rows_sharding = jax.sharding.NamedSharding(
                    self.sharding.mesh, jax.sharding.PartitionSpec(self.sharding.spec[0])
                )
                values = np.ascontiguousarray(windows[:, len(FIELDS), 0]).view(np.float32)
                out[REFERENCE_FIELD] = jax.make_array_from_process_local_data(
                    rows_sharding, values, shape[:1]
                )
            return out
        windows = np.stack([dataset[first + r] for r in rows])
        if windows.ndim == 3:  # packed: (rows, field, T)
            parts = {name: windows[:, k] for k, name in enumerate(PACKED_FIELDS)}
        else:
            parts = {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
        return {
            name: jax.make_array_from_process_local_data(self.sharding, part, shape)
            for name, part in parts.items()
        }

    def train_batch(self, step: int) -> dict[str, jax.Array]:
        return self._assemble(self.train, self.consumed_samples(step))

    def eval_batch(self, i: int, source: str | None = None) -> dict[str, jax.Array]:
        """Held-out batch i (of a mixture's `source` when given)."""
        dataset = self.val if source is None else self.val_sources[source]
        return self._assemble(dataset, i * self.global_batch_size)

    def global_numpy_batch(self, step: int) -> np.ndarray:
        """The whole global batch of windows (of pairs) for `step`, on the host (for tests and tools)."""
        first = self.consumed_samples(step)
        return np.stack([self.train[first + r] for r in range(self.global_batch_size)])


def _windows(data_cfg, vocab_size: int, T: int, packing: str, what: str, held_out: bool = True,
             objective: str = "lm", precomputed: bool = False):  # fmt: skip
    """(train windows, held-out windows, description, held-out bytes per token or None) of one
    data path; `held_out`: see load_tokens."""
    train_tokens, val_tokens, desc, bytes_per_token = load_tokens(data_cfg, vocab_size, held_out)
    paired = isinstance(train_tokens, TokenStream) and train_tokens.paired
    if paired != (objective != "lm"):
        raise UserError(
            f"{what} is preference data (prompt/chosen/rejected pairs), which train.objective = dpo, simpo or orpo "
            f"trains on, not {objective!r}; set train.objective"
            if paired
            else f"train.objective = {objective} trains on preference pairs, but {what} is not preference data: "
            f"prepare prompt/chosen/rejected rows with spmd-data prepare --format preference"
        )
    if paired:
        from spmd.data.preference import PairSource

        if not len(train_tokens.doc_ends):
            raise UserError(
                f"{what} holds no training pairs; prepare more rows (or a smaller --val-fraction)"
            )

        reference = {"train": None, "val": None}
        if precomputed:
            from spmd.data.preference import read_reference

            record, reference = read_reference(prepared_dir(data_cfg), what)
            desc += f"; reference log-probabilities of {record['checkpoint']}"
        return (PairSource(train_tokens, T, what, reference["train"]), PairSource(val_tokens, T, what, reference["val"]),
                desc + "; preference pairs, each sequence padded to the window", None)  # fmt: skip
    splits = (
        (("training", train_tokens), ("held-out", val_tokens)) if held_out else (("training", train_tokens),)
    )
    for split, tokens in splits:
        if len(tokens) < T + 1:
            raise UserError(
                f"train.seq_len {T} is longer than the {split} data of {what} ({len(tokens)} tokens); "
                f"use a shorter train.seq_len or more data"
            )
    if packing == "segments":
        if not isinstance(train_tokens, TokenStream):
            raise UserError(
                f"data.packing = segments needs to know where documents end, which {what} does not: "
                f"prepare the data with spmd-data prepare and point {what} at its output directory"
            )
        return PackedWindowSource(train_tokens, T), PackedWindowSource(val_tokens, T), desc, bytes_per_token
    if isinstance(train_tokens, TokenStream) and train_tokens.masks is not None:
        raise UserError(
            f"{what} is chat data with a loss mask, which only data.packing = segments applies (it also keeps "
            f"conversations apart); set data.packing=segments"
        )
    return WindowSource(train_tokens, T), WindowSource(val_tokens, T), desc, bytes_per_token


def mixture_order(weights: list[float]) -> grain.MapDataset:
    """Which source each sample of a mixture comes from: grain's deterministic weighted
    interleave, a pure function of the sample index (exact proportions over any stretch)."""
    tags = [grain.MapDataset.source([k]).repeat() for k in range(len(weights))]
    return grain.MapDataset.mix(tags, weights=weights)


def make_batches(cfg, sharding, held_out: bool | None = None) -> Batches:
    """The run's batches; `held_out`: whether evaluation will draw held-out batches (default:
    train.eval_every > 0), without which the data need have none."""
    T, data = cfg.train.seq_len, cfg.data
    held_out = cfg.train.eval_every > 0 if held_out is None else held_out
    seed = cfg.train.seed % 2**32
    if not data.sources:
        train_src, val_src, desc, bytes_per_token = _windows(
            data, cfg.model.vocab_size, T, data.packing, "data.path", held_out, cfg.train.objective,
            precomputed_reference(cfg),
        )  # fmt: skip
        if data.packing == "segments" and cfg.train.objective == "lm":
            desc += "; packing: segments (no padding)"
        train = grain.MapDataset.source(train_src).shuffle(seed=seed).repeat()
        val = grain.MapDataset.source(val_src).repeat()
        return Batches(
            train, val, cfg.train.global_batch_size, T, sharding, desc, len(train_src), len(val_src),
            val_bytes_per_token=bytes_per_token, rows_per_sample=1 if cfg.train.objective == "lm" else 2,
        )  # fmt: skip
    # A mixture: each source shuffled with its own seed, then interleaved by weight.
    trains, vals, descs, n_train = [], {}, [], 0
    for k, src in enumerate(data.sources):
        if not pathlib.Path(src.path).expanduser().exists():
            raise UserError(f"data.sources {src.label!r}: {src.path!r} not found")
        one = dataclasses.replace(data, path=src.path, sources=())
        train_src, val_src, desc, _ = _windows(
            one, cfg.model.vocab_size, T, data.packing, f"source {src.label!r}", held_out, cfg.train.objective,
            precomputed_reference(cfg),
        )  # fmt: skip
        trains.append(grain.MapDataset.source(train_src).shuffle(seed=(seed + k) % 2**32).repeat())
        vals[src.label] = grain.MapDataset.source(val_src).repeat()
        descs.append(f"{src.label} (weight {src.weight:g}): {desc}")
        n_train += len(train_src)
    weights = [src.weight for src in data.sources]
    train = grain.MapDataset.mix(trains, weights=weights)
    desc = (
        "mixture of "
        + "; ".join(descs)
        + (f"; packing: {data.packing}" + (" (no padding)" if data.packing == "segments" else ""))
    )
    first = next(iter(vals.values()))
    batches = Batches(train, first, cfg.train.global_batch_size, T, sharding, desc, n_train, len(first),
                      rows_per_sample=1 if cfg.train.objective == "lm" else 2)  # fmt: skip
    batches.val_sources = vals
    return batches
