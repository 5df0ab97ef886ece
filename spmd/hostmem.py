"""Host memory for XLA:CPU programs: freed heap memory kept for the next step (`train.host_heap`).

XLA:CPU allocates each execution's temporaries as one block (169 MiB for `small`'s bf16 train
step) and frees it when the execution ends. glibc serves a block that large with a fresh `mmap`
and unmaps it on free, so every step faults its whole temporary buffer in again, page by page:
43,000 page faults and 60-80 ms of kernel time per step of `small` bf16 (a ~160 ms step). With
mmap off, the top of the heap never trimmed and one arena for all threads, the step reuses the same
memory: no faults, the step 1.21x faster (docs/performance.md, issue 19). PyTorch's CPU guides get
the same from jemalloc or tcmalloc through LD_PRELOAD; glibc's own switches (`mallopt`) do it in
the running process, with no new dependency.

The price: memory a program frees stays with the process (its resident size stays at its peak),
and threads share one allocator arena. Both suit a training process, which reaches its peak in the
first step and keeps it. Elsewhere than glibc (macOS, musl) nothing changes.
"""

import ctypes
import ctypes.util

HOST_HEAP = ("auto", "retain", "system")

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_retained = False


def wanted(setting: str, on_cpu: bool) -> bool:
    """Whether `train.host_heap=setting` keeps freed memory, `on_cpu`: whether the run's devices
    are this host's CPUs (`auto` retains only then)."""
    return setting == "retain" or (setting == "auto" and on_cpu)


def retain_freed_memory() -> bool:
    """Switch glibc's malloc to keep freed memory for reuse (see the module's docstring), once per
    process. Returns whether the process now does (False where the C library is not glibc)."""
    global _retained
    if _retained:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_MAX, 0),  # large blocks from the heap, not from fresh mappings
            # never hand the heap's free top back to the system: -1 is "never" (mallopt(3)); the
            # largest positive value, 2**31 - 1, still trimmed a free top over 2 GiB, and a step
            # with 1.2 GiB of temporaries (d 512 / 8 layers / T 512 fp32) then faulted them in
            # again in ~1 step of 3, some taking 2x as long (docs/performance.md, issue 19)
            (_M_TRIM_THRESHOLD, -1),
            (_M_ARENA_MAX, 1),  # one arena: another thread's arena maps its large blocks anyway
        )
    )
    _retained = ok
    return ok


def retained() -> bool:
    return _retained


def retain_before_start(setting: str) -> None:
    """Apply `train.host_heap=setting` before JAX starts its threads, as commands do (through
    spmd.setup.before_jax_starts): a thread keeps the allocator arena it first used, so once
    XLA:CPU's threads run, their temporaries come from their own arenas, which map large blocks
    afresh whatever mallopt says. Measured: a jitted train step of `small` bf16 still faulted its
    171 MiB in every step when switched after JAX had started, none when before. `auto` only where
    JAX was told to use the CPU (--host-devices, JAX_PLATFORMS=cpu)."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    if wanted(setting, on_cpu=(jax.config.jax_platforms or "") == "cpu"):
        retain_freed_memory()
