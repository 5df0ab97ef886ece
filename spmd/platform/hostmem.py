"""Host memory for XLA:CPU programs: freed heap memory kept for the next step (`cpu.host_heap`).

XLA:CPU allocates each execution's temporaries as one block and frees it when the execution ends.
glibc serves a block that large with a fresh `mmap` and unmaps it on free, so every step faults its
whole temporary buffer in again, page by page: kernel time that can be a large share of a small
CPU step. With mmap off, the top of the heap never trimmed and one arena for all threads, the step
reuses the same memory and faults nothing (figures: docs/performance.md). PyTorch's CPU guides get
the same from jemalloc or tcmalloc through LD_PRELOAD; glibc's own switches (`mallopt`) do it in
the running process, with no new dependency.

The price: memory a program frees stays with the process (its resident size stays at its peak),
and threads share one allocator arena. Both suit a training process, which reaches its peak in the
first step and keeps it. Elsewhere than glibc (macOS, musl) nothing changes.

**tbbmalloc** (`auto`'s choice on a CPU host where the `tbb` wheel is installed): glibc keeps the
freed block but carves small, longer-lived allocations out of it between steps, so now and then
the next step's block no longer fits, the heap grows and the step faults a whole new block in
(steps several times their usual time now and then, the resident size up to twice the step's
need). Intel's scalable allocator (oneTBB's tbbmalloc, a pip wheel) keeps large
blocks in a cache of their own, apart from small objects. It must replace malloc before the
process starts (`LD_PRELOAD`, its proxy library), so a command relaunches itself once under it
(`os.execve`: same pid, arguments and environment) before JAX starts; a library call (a test
calling `main(argv)`) cannot and retains glibc's memory instead. End to end it makes CPU runs no
slower and often faster, at a smaller resident size (figures: docs/performance.md).
"""

import ctypes
import ctypes.util
import importlib.metadata
import os
import pathlib
import sys

from spmd.core.errors import UserError

HOST_HEAP = ("auto", "tbbmalloc", "retain", "system")

# tbbmalloc's libraries in the `tbb` wheel (installed into the environment's lib/), in LD_PRELOAD
# order: the allocator, then the proxy that routes malloc/free/new/delete to it
TBBMALLOC_LIBRARIES = ("libtbbmalloc.so.2", "libtbbmalloc_proxy.so.2")
# Blocks from this size up are "huge" to tbbmalloc: cached for reuse and never handed back to the
# system (its default returns them, and every step faulted its temporaries in again). 1 MiB:
# every XLA temporary block and large array.
TBBMALLOC_KEEP_FROM_BYTES = 1 << 20
# Set by the relaunch for the new image of the process: "<pid>:<LD_PRELOAD before it>". The pid
# (unchanged by exec) stops a second relaunch when the preload did not take; children relaunch
# themselves, and the variables are restored to what they were so that children see the
# caller's environment.
RELAUNCHED = "SPMD_TBBMALLOC_RELAUNCHED"

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_retained = False


def choose(setting: str, on_cpu: bool, tbbmalloc_ok: bool) -> str:
    """What `cpu.host_heap=setting` does: "tbbmalloc", "retain" or "system". `on_cpu`: the run's
    devices are this host's CPUs (`auto` acts only then); `tbbmalloc_ok`: the process can relaunch
    under tbbmalloc (or already runs under it)."""
    if setting == "auto":
        setting = ("tbbmalloc" if tbbmalloc_ok else "retain") if on_cpu else "system"
    if setting == "tbbmalloc" and not tbbmalloc_ok:
        return "retain"
    return setting


def wanted(setting: str, on_cpu: bool) -> bool:
    """Whether `cpu.host_heap=setting` keeps freed memory in a process that cannot relaunch."""
    return choose(setting, on_cpu, tbbmalloc_ok=False) != "system"


def cpu_host(platforms: str | None = None) -> bool:
    """Whether JAX will run on this host's CPUs, decided before it starts: told so (--host-devices,
    JAX_PLATFORMS=cpu) or, with no platform named, no TPU chip or GPU visible (as JAX itself looks,
    through the PCI bus and device files; nothing is initialised). `platforms`: JAX's setting (by
    default the one in effect)."""
    if platforms is None:
        import jax

        platforms = jax.config.jax_platforms or ""
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    try:
        from jax._src import hardware_utils as hw

        return not (
            hw.num_available_tpu_chips_and_device_id()[0]
            or hw.has_visible_nvidia_gpu()
            or hw.num_available_amd_gpus(stop_at=1)
        )
    except Exception:  # noqa: BLE001 - JAX's private helpers moved: act as on an accelerator host
        return False


def tbbmalloc_libraries() -> list[str] | None:
    """Paths of tbbmalloc and its malloc proxy from the installed `tbb` wheel (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = importlib.metadata.files("tbb") or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    found = {f.name: pathlib.Path(f.locate()).resolve() for f in files if f.name in TBBMALLOC_LIBRARIES}
    paths = [found.get(name) for name in TBBMALLOC_LIBRARIES]
    return [str(p) for p in paths] if all(p is not None and p.is_file() for p in paths) else None


def tbbmalloc_active() -> bool:
    """Whether this process's malloc is tbbmalloc's (its proxy was preloaded)."""
    return hasattr(ctypes.CDLL(None), "__TBB_malloc_proxy")


def relaunch_under_tbbmalloc(libraries: list[str]) -> None:
    """Replace this process by the same command with tbbmalloc preloaded (does not return). Called
    before JAX starts, by a command run from its command line."""
    env = dict(os.environ)
    before = env.get("LD_PRELOAD", "")
    env[RELAUNCHED] = f"{os.getpid()}:{before}"
    env["LD_PRELOAD"] = " ".join([*libraries, *([before] if before else [])])
    env.setdefault("TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD", str(TBBMALLOC_KEEP_FROM_BYTES))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _after_relaunch() -> bool:
    """In the relaunched process: restore the environment children should see; whether this
    process is such a relaunch."""
    mark = os.environ.get(RELAUNCHED, "")
    pid, _, before = mark.partition(":")
    if pid != str(os.getpid()):
        return False
    del os.environ[RELAUNCHED]
    if before:
        os.environ["LD_PRELOAD"] = before
    else:
        os.environ.pop("LD_PRELOAD", None)
    if os.environ.get("TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD") == str(TBBMALLOC_KEEP_FROM_BYTES):
        os.environ.pop("TBB_MALLOC_SET_HUGE_SIZE_THRESHOLD")
    return True


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
            # with more temporaries than that then faulted them in again every few steps
            (_M_TRIM_THRESHOLD, -1),
            (_M_ARENA_MAX, 1),  # one arena: another thread's arena maps its large blocks anyway
        )
    )
    _retained = ok
    return ok


def retained() -> bool:
    """Whether freed memory stays with the process (glibc retaining it, or tbbmalloc)."""
    return active() != "system"


def active() -> str:
    """The host heap this process runs with: "tbbmalloc", "retain" or "system"."""
    return "tbbmalloc" if tbbmalloc_active() else "retain" if _retained else "system"


def prepare(setting: str, may_relaunch: bool) -> None:
    """Apply `cpu.host_heap=setting` before JAX starts (spmd.assembly.setup.before_jax_starts). A command
    run from its command line (`may_relaunch`) relaunches itself under tbbmalloc when that is the
    choice; otherwise glibc's freed memory is retained where the choice is not "system"."""
    relaunched = _after_relaunch()
    if tbbmalloc_active():
        return
    libraries = tbbmalloc_libraries()
    if setting == "tbbmalloc" and libraries is None:
        raise UserError(
            "cpu.host_heap=tbbmalloc needs Intel's tbb wheel (Linux x86-64): pip install tbb; "
            "or set cpu.host_heap=retain"
        )
    can_relaunch = may_relaunch and libraries is not None and not relaunched
    on_cpu = cpu_host()
    if choose(setting, on_cpu, can_relaunch) == "tbbmalloc":
        relaunch_under_tbbmalloc(libraries)
    retain_before_start(setting, on_cpu)


def retain_before_start(setting: str, on_cpu: bool | None = None) -> None:
    """Apply `cpu.host_heap=setting` before JAX starts its threads, as commands do (through
    spmd.assembly.setup.before_jax_starts): a thread keeps the allocator arena it first used, so once
    XLA:CPU's threads run, their temporaries come from their own arenas, which map large blocks
    afresh whatever mallopt says (a train step switched after JAX had started still faulted its
    temporaries in every step). `auto` only on a CPU host (`on_cpu`; by default `cpu_host()`)."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() or tbbmalloc_active():
        return
    if wanted(setting, on_cpu=cpu_host() if on_cpu is None else on_cpu):
        retain_freed_memory()
