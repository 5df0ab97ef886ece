"""One trainer per run directory: `<run-dir>/.lock` names the host and process that holds it.

Created with O_EXCL, so two trainers cannot both take it. A lock whose process is gone (killed,
crashed) on this host is stale and taken over, so a restart loop never needs a hand to clear it; a
lock held from another host is respected (we cannot tell whether that process lives). In a
multi-process job process 0 holds the lock and every process learns whether it got it, so all
fail alike.
"""

import json
import os
import pathlib
import socket
import time

from spmd.core.errors import UserError

LOCK = ".lock"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    started = _start_time(pid)
    return started is None or holder.get("start") in (None, started)


class RunLock:
    def __init__(self, path: pathlib.Path | None):
        self.path = path

    def release(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def _take(run_dir: pathlib.Path) -> pathlib.Path:
    path = run_dir / LOCK
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}  # being written right now, or garbage from a crash
            if holder.get("host") == me["host"] and not _alive(holder):
                path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            if not holder:
                time.sleep(0.2)
                continue
            raise UserError(
                f"run directory {str(run_dir)!r} is in use by process {holder.get('pid')} on "
                f"{holder.get('host')} (since {holder.get('since')}); wait for it to finish or stop it "
                f"(a lock left by a crash on another host: remove {path})"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise UserError(
        f"could not take the lock {path}: it names no trainer (not the JSON record of a host and process: "
        f"left half-written by a crash, or edited); if no trainer is starting in {str(run_dir)!r}, remove it"
    )


def acquire(run_dir: pathlib.Path) -> RunLock:
    """Take the run directory's lock (creating the directory), or raise UserError naming the holder."""
    import jax

    error = None
    path = None
    if jax.process_index() == 0:
        try:
            if run_dir.exists() and not run_dir.is_dir():
                raise UserError(f"--run-dir {str(run_dir)!r} is a file; give a directory")
            run_dir.mkdir(parents=True, exist_ok=True)
            path = _take(run_dir)
        except UserError as e:
            error = e
        except OSError as e:
            error = UserError(f"--run-dir {str(run_dir)!r} cannot be created or locked: {e.strerror}")
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if failed and error is None:
            error = UserError(f"run directory {str(run_dir)!r} is locked by another trainer (process 0 says)")
    if error is not None:
        raise error
    return RunLock(path)
