"""Which library runs the matmuls of XLA:CPU train and eval steps (`cpu.matmul`).

XLA:CPU hands a dot to one of its libraries: YNNPACK (its default for the dots it accepts), Eigen
(the rest), or oneDNN (Intel's, which PyTorch's CPU backend uses) when asked. oneDNN runs bf16
matmuls faster on CPUs with AMX, and also takes the dots YNNPACK refuses (a transposed left
operand: the weight gradient x^T g, and in attention's backward p^T do and ds^T q), which Eigen
runs on operands converted to fp32; the train steps are faster with it (figures:
docs/performance.md). oneDNN takes dots whose output has the
operands' dtype; a bf16 dot with an fp32 output is converted to fp32 first, so the model writes
its CPU dots with the compute dtype's output where the result is rounded to it anyway.

Set per program (jit's compiler options), not through XLA_FLAGS: nothing else in the process
changes. GPU and TPU programs get no options. Such programs are not kept in JAX's persistent
compilation cache (below).
"""

import collections
import functools
import warnings

import jax

from spmd.analysis import hlo as hlo_lib

# XLA cannot serialise a program with oneDNN thunks yet ("ToProto is not implemented for thunk
# kind: onednn-fusion"): where JAX's persistent compilation cache is on it warns at each such
# program and keeps it in memory only; the program compiles and runs as usual. One message per
# program would bury a run's own errors and warnings.
warnings.filterwarnings("ignore", message=r"Error writing persistent compilation cache entry.*onednn-fusion")

CPU_MATMUL = ("auto", "onednn", "xla")  # "xla": XLA:CPU's own choice (YNNPACK, Eigen)

# The CPU instructions oneDNN needs to multiply a dtype at speed. Without them it runs reference
# kernels: on a Xeon with AVX-512 but neither AVX-512 BF16 nor AMX, the bf16 train step of `small`
# took 170-245 s a step in oneDNN against 0.41 s in XLA's own libraries (which convert to fp32).
_HARDWARE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@functools.cache
def _cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def in_hardware(dtype: str) -> bool:
    """Whether this host's CPU has the instructions oneDNN multiplies `dtype` with (fp32: always)."""
    wanted = _HARDWARE_FLAGS.get(dtype)
    return wanted is None or any(flag in _cpu_flags() for flag in wanted)


# Each dot its own oneDNN call (LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT). XLA's other oneDNN mode
# (LIBRARY_FUSION_TYPE_DOT) also fuses a dot's elementwise consumers (add, multiply, subtract, exp)
# into its oneDNN call, and jax 0.12 computes some such fusions wrong, silently: a dot times a
# broadcast operand O(100)x off once the dot sums over more than 512 elements, a dot followed by
# two operations O(1) off at any size, the Pallas flash kernel's causal backward with dq all zeros
# (tests/test_cpu_matmul.py pins it). The same programs with individual dots are right, the train
# steps about as fast (a gradient sum after a dot becomes a pass of its own), and programs that had
# such fusions (Muon's orthogonalisation, some expert-parallel MoE steps) keep oneDNN where they
# fell back to XLA's libraries.
_ONEDNN = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}


def compiler_options(library: str) -> dict | None:
    """XLA compiler options for a CPU step program whose matmuls run in `library` (spmd.assembly.policy.matmul
    resolves it: "onednn", or "xla" for XLA's own)."""
    return dict(_ONEDNN) if library == "onednn" else None


# XLA:CPU (jax 0.12) aborts the process when a program with oneDNN fusions is freed as an execution
# of it ends (`object_pool.h: Check failed: available_.size() == num_created_`): a fusion hands its
# oneDNN runtime back to the thunk's pool in a callback on its done event, and such callbacks run
# last-registered first, so the executor's continuation, which ends the execution and drops the
# program where its caller already has, runs before the hand-back (XLA's onednn_fusion_thunk.cc,
# tsl's AsyncValue::RunWaiters). Measured: fresh programs dropped while they ran aborted within
# 1-19 programs, dropped just after their outputs were ready within 61-137; a CI run of the suite
# aborted once. So the newest KEPT_PROGRAMS oneDNN programs are kept here as well: a run builds
# two (train and eval step), and a test or script that builds more frees a program only after
# that many newer ones were built, long after its last execution ended.
KEPT_PROGRAMS = 8
_kept: collections.deque = collections.deque(maxlen=KEPT_PROGRAMS)


def keep(program):
    """Keep `program` (a jitted function or a compiled one) alive until KEPT_PROGRAMS newer ones
    are kept (above); returns it."""
    _kept.append(program)
    return program


# A guard, since jax is not pinned: a compiled oneDNN program must call oneDNN for lone dots only
# (what _ONEDNN asks for); one with any other oneDNN fusion, which a later XLA might form, is
# compiled again without oneDNN (XLA's own libraries), with a warning naming the fusion.
ONEDNN_FUSION_KIND = "__onednn_fusion"


def unsafe_onednn_fusions(hlo_text: str) -> list[str]:
    """The oneDNN fusions of an optimised module that are more than one dot, as "name: ops"."""
    bad = []
    for name, body in hlo_lib.library_fusions(hlo_text, ONEDNN_FUSION_KIND).items():
        ops = [op for _, op, _, _ in body if op != "parameter"]
        if ops != ["dot"]:
            bad.append(f"{name}: {' + '.join(ops)}")
    return bad


_SIGNATURE = ("shape", "dtype", "weak_type", "sharding")  # what picks a compiled program for an argument


class CheckedJit:
    """`jax.jit(fun, compiler_options=<oneDNN>)` whose programs are checked as they compile (per
    input signature, whether called or lowered and compiled): a program with unsafe oneDNN fusions
    (unsafe_onednn_fusions) is replaced by `fun` compiled without oneDNN. Kept programs: see keep."""

    def __init__(self, fun, options: dict, jit_kwargs: dict):
        # jit_kwargs' own compiler_options (if any) go to both programs, oneDNN's to the first only
        rest = {k: v for k, v in jit_kwargs.items() if k != "compiler_options"}
        base = jit_kwargs.get("compiler_options") or {}
        self._onednn = jax.jit(fun, compiler_options=base | options, **rest)
        self._plain = jax.jit(fun, **jit_kwargs)
        self._programs = {}
        self.fallbacks: list[str] = []  # the unsafe fusions of each program compiled without oneDNN

    def lower(self, *args, **kwargs):
        return _CheckedLowered(self, self._onednn.lower(*args, **kwargs), args, kwargs)

    def __call__(self, *args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        key = (tree, *((type(x), *(getattr(x, a, None) for a in _SIGNATURE)) for x in leaves))
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self.lower(*args, **kwargs).compile()
        return program(*args, **kwargs)

    def _checked(self, compiled, args, kwargs):
        bad = unsafe_onednn_fusions(compiled.as_text())
        if not bad:
            return compiled
        self.fallbacks += bad
        warnings.warn(
            f"oneDNN fusions of more than a dot, which XLA has computed wrong, in {len(bad)} place(s) "
            f"({bad[0]}, ...): this program runs with XLA's own matmul libraries instead "
            "(spmd/platform/cpu_matmul.py, unsafe_onednn_fusions)",
            stacklevel=3,
        )
        return self._plain.lower(*args, **kwargs).compile()


class _CheckedLowered:
    """A lowered CheckedJit program: compile() checks (CheckedJit); the rest is jax's Lowered."""

    def __init__(self, owner: CheckedJit, lowered, args, kwargs):
        self._owner, self._lowered, self._args, self._kwargs = owner, lowered, args, kwargs

    def compile(self, *a, **kw):
        return self._owner._checked(self._lowered.compile(*a, **kw), self._args, self._kwargs)

    def __getattr__(self, name):
        return getattr(self._lowered, name)


def jit(fun, library: str, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` with its matmuls in `library` (compiler_options); a oneDNN program
    is a CheckedJit, and kept (keep)."""
    options = compiler_options(library)
    return keep(CheckedJit(fun, options, jit_kwargs)) if options else jax.jit(fun, **jit_kwargs)


def raw_onednn_jit(fun):
    """`jax.jit(fun)` with oneDNN's options on CPU and no check (what XLA computes as such, for
    tests), kept alive like every oneDNN program (keep)."""
    return keep(jax.jit(fun, compiler_options=compiler_options("onednn")))
