"""Out of device memory as one error line, not a traceback: a compiled step checked against the
device's memory before it runs, and XLA's RESOURCE_EXHAUSTED (at compile or at run time) turned
into the same message: what the step needs, what the device has, and the levers.

The check reads the compiled program's own memory analysis (spmd.analysis.aot.peak_bytes: arguments,
outputs and temporaries per device) and the device's `bytes_limit` (GPU and TPU report it; a CPU
host has no such limit, and is not checked).
"""

import contextlib
import re

import jax

from spmd.analysis.aot import peak_bytes
from spmd.core.errors import UserError
from spmd.parallel.sharding import fmt_bytes

LEVERS = (
    "model.remat=full (or save_dots)",
    "train.microbatches=N",
    "a smaller train.global_batch_size",
    "more fsdp (--mesh, --rules fsdp)",
    "optimizer.offload=true",
    "another model.attention_impl (cudnn, pallas, chunked)",
)


class OutOfMemory(UserError):
    """A step that does not fit the device's memory."""


def device_limit(device) -> int | None:
    """The bytes a device's programs may hold (None where the platform reports none: CPU)."""
    try:
        stats = device.memory_stats()
    except (RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def message(what: str, device, limit: int | None, need: int | None = None, failed: int | None = None) -> str:
    has = f"{device.device_kind} has {fmt_bytes(limit)}" if limit else f"on {device.device_kind}"
    if need:
        said = f"{what} needs {fmt_bytes(need)} per device but {has}"
    else:
        allocation = f"an allocation of {fmt_bytes(failed)} failed; " if failed else ""
        said = f"{what} ran out of device memory ({allocation}{has})"
    return f"{said}; to need less per device: {', '.join(LEVERS)}"


def check_fits(compiled, what: str, device=None) -> None:
    """Raise OutOfMemory when `compiled` needs more than the device holds (checked before it runs)."""
    device = device or jax.devices()[0]
    limit = device_limit(device)
    if limit is None:
        return
    mem = compiled.memory_analysis()
    need = peak_bytes(mem) if mem is not None else None
    if need and need > limit:
        raise OutOfMemory(message(what, device, limit, need=need))


def _sizes(text: str) -> tuple[int | None, int | None]:
    """(bytes the program needs, bytes of the allocation that failed) as XLA's out-of-memory
    messages say them: TPU "Used 98.31G of 95.74G hbm", GPU "... allocate 1073741824 bytes"."""
    used = re.search(r"Used (\d+(?:\.\d+)?)([KMGT]) of", text)
    need = int(float(used.group(1)) * 1024 ** ("KMGT".index(used.group(2)) + 1)) if used else None
    failed = re.search(r"allocat\w* (\d+) bytes", text)
    return need, int(failed.group(1)) if failed else None


@contextlib.contextmanager
def as_error(what: str, device=None):
    """RESOURCE_EXHAUSTED inside the block becomes OutOfMemory (other errors pass through)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
            raise
        device = device or jax.devices()[0]
        need, failed = _sizes(text)
        raise OutOfMemory(message(what, device, device_limit(device), need, failed)) from None
