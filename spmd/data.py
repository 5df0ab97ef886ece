"""Data: token streams, fixed-length windows, and global batches that are a pure function of the step.

The batch for optimizer step `s` holds the windows at positions `s*B .. s*B+B-1` of a grain
`MapDataset` that is shuffled with the run's seed and reshuffled every epoch. Nothing but the
step (and the samples consumed, should the global batch size change on resume) is needed to find
the next batch, so the data position survives a restart on any number of devices or processes.

Each process reads only the rows of the global batch that its devices hold, and the batch is
assembled with `jax.make_array_from_process_local_data`.
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

from spmd.errors import UserError


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPMD_CACHE_DIR", pathlib.Path.home() / ".cache" / "spmd"))


def _atomic_save(path: pathlib.Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def stdlib_corpus(val_fraction: float) -> tuple[pathlib.Path, pathlib.Path]:
    """Byte tokens of this Python's standard library source (*.py), split by file.

    Files are read in sorted order of their relative path; a file goes to the held-out split when
    crc32(relative path) falls in the lowest `val_fraction` of the range. Built once, then cached.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (f for f in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(f.parts)),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    listing = "\n".join(f.relative_to(root).as_posix() for f in files)
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


def _read_text(path: pathlib.Path) -> np.ndarray:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def load_tokens(data_cfg, vocab_size: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(train tokens, held-out tokens, a description) as 1-D integer arrays (memory-mapped when possible)."""
    if not data_cfg.path:
        train_path, val_path = stdlib_corpus(data_cfg.val_fraction)
        train, val = np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r")
        desc = f"embedded corpus: Python {sys.version.split()[0]} standard library source, bytes ({train_path.parent})"
    else:
        path = pathlib.Path(data_cfg.path).expanduser()
        if not path.exists():
            raise UserError(
                f"data file {str(path)!r} not found; fix data.path, or leave it empty for the embedded corpus"
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
        if tokens.size == 0:
            raise UserError(
                f"data {str(path)!r} is empty; point data.path at a file or directory with content"
            )
        n_val = max(1, int(len(tokens) * data_cfg.val_fraction))
        train, val = tokens[:-n_val], tokens[-n_val:]
        desc = f"{str(path)} ({fmt}, {len(tokens):,} tokens)"
    mask = data_cfg.mask_token_id
    head = np.asarray(train[: 1 << 20])
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
    return train, val, desc


class WindowSource:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


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

    def resume_at(self, step: int, consumed_samples: int) -> None:
        self.start_step, self.start_sample = step, consumed_samples

    def consumed_samples(self, step: int) -> int:
        """Samples drawn by the batches before `step`."""
        return self.start_sample + (step - self.start_step) * self.global_batch_size

    @functools.cached_property
    def local_rows(self) -> range:
        """Rows of the global batch held by this process's devices (a contiguous range)."""
        index_map = self.sharding.addressable_devices_indices_map((self.global_batch_size, self.seq_len))
        starts = [idx[0].start or 0 for idx in index_map.values()]
        stops = [
            idx[0].stop if idx[0].stop is not None else self.global_batch_size for idx in index_map.values()
        ]
        return range(min(starts), max(stops))

    def _assemble(self, dataset, first: int) -> dict[str, jax.Array]:
        rows = self.local_rows
        windows = np.stack([dataset[first + r] for r in rows])
        shape = (self.global_batch_size, self.seq_len)
        return {
            name: jax.make_array_from_process_local_data(self.sharding, part, shape)
            for name, part in (("inputs", windows[:, :-1]), ("targets", windows[:, 1:]))
        }

    def train_batch(self, step: int) -> dict[str, jax.Array]:
        return self._assemble(self.train, self.consumed_samples(step))

    def eval_batch(self, i: int) -> dict[str, jax.Array]:
        return self._assemble(self.val, i * self.global_batch_size)

    def global_numpy_batch(self, step: int) -> np.ndarray:
        """The whole global batch of windows for `step`, on the host (for tests and tools)."""
        first = self.consumed_samples(step)
        return np.stack([self.train[first + r] for r in range(self.global_batch_size)])


def make_batches(cfg, sharding) -> Batches:
    train_tokens, val_tokens, desc = load_tokens(cfg.data, cfg.model.vocab_size)
    T = cfg.train.seq_len
    for split, tokens in (("training", train_tokens), ("held-out", val_tokens)):
        if len(tokens) < T + 1:
            raise UserError(
                f"train.seq_len {T} is longer than the {split} data ({len(tokens)} tokens); "
                f"use a shorter train.seq_len or more data"
            )
    train_src, val_src = WindowSource(train_tokens, T), WindowSource(val_tokens, T)
    seed = cfg.train.seed % 2**32
    train = grain.MapDataset.source(train_src).shuffle(seed=seed).repeat()
    val = grain.MapDataset.source(val_src).repeat()
    return Batches(train, val, cfg.train.global_batch_size, T, sharding, desc, len(train_src), len(val_src))
