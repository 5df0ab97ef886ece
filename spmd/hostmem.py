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

With the heap retained, `train.host_huge_pages` backs it with 2 MiB transparent huge pages where
the kernel offers them only on request (THP mode `madvise`, the common default): one TLB entry per
2 MiB instead of 512, for dots and element-wise passes over arrays of many MiB; the train steps of
`small` and of a d 512 / 8-layer model ran 1.05-1.08x faster, fp32 and bf16 (docs/performance.md,
issue 19). glibc does the same with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, read only when a
process starts; in the running process the heap is instead grown once, unused, to half the host's
memory (address space only: nothing is touched, so nothing becomes resident), advised as huge-page
memory and freed back to the never-trimmed heap, from which later allocations are carved. Memory
beyond that reservation grows the heap in ordinary pages. Not done where the kernel never gives
huge pages or gives them anyway (THP `never`, `always`) or counts every reserved byte
(`vm.overcommit_memory=2`).
"""

import ctypes
import ctypes.util
import os
import re

HOST_HEAP = ("auto", "retain", "system")

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_MADV_HUGEPAGE = 14

HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"

_retained = False
_huge_pages = False


def wanted(setting: str, on_cpu: bool) -> bool:
    """Whether `train.host_heap=setting` keeps freed memory, `on_cpu`: whether the run's devices
    are this host's CPUs (`auto` retains only then)."""
    return setting == "retain" or (setting == "auto" and on_cpu)


def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def retain_freed_memory(huge_pages: bool = False) -> bool:
    """Switch glibc's malloc to keep freed memory for reuse (see the module's docstring), once per
    process, and with `huge_pages` back the heap with transparent huge pages where the kernel
    offers them on request. Returns whether the process now keeps freed memory (False where the
    C library is not glibc)."""
    global _retained, _huge_pages
    if _retained:
        return True
    libc = _glibc()
    if libc is None:
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
    if ok and huge_pages:
        _huge_pages = _advise_heap(libc)
    return ok


def retained() -> bool:
    return _retained


def huge_pages() -> bool:
    """Whether this process's retained heap was advised as huge-page memory."""
    return _huge_pages


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"; "" where unknown)."""
    try:
        with open(THP_MODE) as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return ""
    return found.group(1) if found else ""


def _heap() -> tuple[int, int] | None:
    """The address range of the process's brk heap ([heap] in /proc/self/maps), or None."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                spans.append((int(lo, 16), int(hi, 16)))
    return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None


def _advise_heap(libc) -> bool:
    """Grow the heap by half the host's memory without touching it, advise it as huge-page memory
    and free it into the (never trimmed) heap; see the module's docstring. Needs mmap off (the
    block must come from the heap) and trimming off (it must stay there)."""
    if thp_mode() != "madvise":
        return False
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if f.read().strip() == "2":
                return False
    except OSError:
        return False
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    reserve = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2 // HUGE_PAGE * HUGE_PAGE
    block = libc.malloc(reserve)
    if not block:
        return False
    try:
        heap = _heap()
        if heap is None or not heap[0] <= block < heap[1]:
            return False  # not from the brk heap (e.g. glibc fell back to a mapping)
        lo = -(-heap[0] // HUGE_PAGE) * HUGE_PAGE
        hi = heap[1] // HUGE_PAGE * HUGE_PAGE
        return hi > lo and libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0
    finally:
        libc.free(block)


def retain_before_start(setting: str, huge_pages: bool = True) -> None:
    """Apply `train.host_heap=setting` (and `train.host_huge_pages=huge_pages`) before JAX starts
    its threads, as commands do (through
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
        retain_freed_memory(huge_pages)
