"""Where the stack keeps files that outlive a run: the per-user cache ($SPMD_CACHE_DIR, else
~/.cache/spmd), shared by data caches, verified-shard records and measured peak FLOP/s."""

import os
import pathlib


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPMD_CACHE_DIR", pathlib.Path.home() / ".cache" / "spmd"))
