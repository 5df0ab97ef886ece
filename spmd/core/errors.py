"""User-facing messages: errors (one `error:` line on stderr, exit code 2, no traceback) and the
log lines commands and runs write to stderr."""

import contextlib
import difflib
import os
import sys
import tempfile


class UserError(Exception):
    """Bad input from the user (flags, config, rules, data). The CLI prints it and exits 2."""


def log(msg: str) -> None:
    """One line for the user on stderr (stdout is for a command's own output)."""
    print(msg, file=sys.stderr, flush=True)


def closest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_writable(path, flag: str) -> None:
    """`path` (a directory a command will create or fill) can be written: its nearest existing
    ancestor is a directory where a new entry can be made (tried, then removed), so an unwritable
    output is one error before any work, not an OSError after it."""
    import pathlib

    path = pathlib.Path(path).expanduser().absolute()
    ancestor = next(p for p in (path, *path.parents) if p.exists())
    if not ancestor.is_dir():
        raise UserError(f"{flag} {str(path)!r} cannot be a directory: {str(ancestor)!r} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".spmd-probe-", dir=ancestor))
    except OSError as e:
        raise UserError(
            f"{flag} {str(path)!r} cannot be written: making an entry in {str(ancestor)!r} failed: {e.strerror}"
        ) from None


_real_stderr_fd: int | None = None


@contextlib.contextmanager
def stderr_parked():
    """Send fd 2 to a temporary file while a library call runs.

    On success fd 2 comes back and what was captured is replayed. On an exception fd 2 stays
    parked: background threads of the failed call (Orbax's TensorStore readers) go on printing
    tracebacks there, and `report` writes our one `error:` line to the real stderr instead.
    """
    global _real_stderr_fd
    sys.stderr.flush()
    saved = os.dup(2)
    parked = tempfile.TemporaryFile()
    os.dup2(parked.fileno(), 2)
    try:
        yield
    except BaseException:
        _real_stderr_fd = saved
        raise
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    parked.seek(0)
    captured = parked.read()
    if captured:
        os.write(2, captured)


@contextlib.contextmanager
def stderr_captured():
    """Send fd 2 to a temporary file while the block runs (C++ libraries such as XLA log there);
    yields a list that holds the captured text once the block is done."""
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    buffer = tempfile.TemporaryFile()
    os.dup2(buffer.fileno(), 2)
    try:
        yield captured
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        buffer.seek(0)
        captured.append(buffer.read().decode("utf-8", errors="replace"))


def report(e: Exception) -> None:
    """Print `error: ...` on the real stderr (even while fd 2 is parked)."""
    sys.stderr.flush()
    os.write(_real_stderr_fd if _real_stderr_fd is not None else 2, f"error: {e}\n".encode())
