"""Which library runs the matmuls of XLA:CPU train and eval steps (`train.cpu_matmul`).

XLA:CPU hands a dot to one of its libraries: YNNPACK (its default for the dots it accepts), Eigen
(the rest), or oneDNN (Intel's, which PyTorch's CPU backend uses) when asked. On the 2-core AMX
machine of issue 19 a lone 2048² bf16 matmul ran at 2,634 GFLOP/s in oneDNN against 1,674 in
YNNPACK, and oneDNN also takes the dots YNNPACK refuses (a transposed left operand: the weight
gradient x^T g, and in attention's backward p^T do and ds^T q), which Eigen ran on operands
converted to fp32. The train step with oneDNN: `small` bf16 1.50x, fp32 1.10x, d 512 / 8 layers /
T 512 bf16 1.58x (docs/performance.md, "Fifth pass"). oneDNN takes dots whose output has the
operands' dtype; a bf16 dot with an fp32 output is converted to fp32 first, so the model writes
its CPU dots with the compute dtype's output where the result is rounded to it anyway.

Set per program (jit's compiler options), not through XLA_FLAGS: nothing else in the process
changes. GPU and TPU programs get no options. Such programs are not kept in JAX's persistent
compilation cache (below).
"""

import collections
import warnings

import jax

# XLA cannot serialise a program with oneDNN thunks yet ("ToProto is not implemented for thunk
# kind: onednn-fusion"): where JAX's persistent compilation cache is on it warns at each such
# program and keeps it in memory only; the program compiles and runs as usual. One message per
# program would bury a run's own errors and warnings.
warnings.filterwarnings("ignore", message=r"Error writing persistent compilation cache entry.*onednn-fusion")

CPU_MATMUL = ("onednn", "xla")  # "xla": XLA:CPU's own choice (YNNPACK, Eigen)

_ONEDNN = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
}


# Attention implementations whose CPU programs keep XLA's libraries: the Pallas kernels run in
# interpret mode on CPU (a correctness path, not a fast one), and with oneDNN's dot fusions XLA
# computed the flash kernel's causal backward wrong: dq all zeros and dk wrong for a one-block
# causal sequence, both 58-75% off in the ring. tests/test_cpu_matmul.py pins it, so that the
# exception goes when XLA is fixed.
KEEPS_XLA_LIBRARIES = ("pallas", "pallas_tpu")


def compiler_options(setting: str, platform: str, attention_impl: str = "xla") -> dict | None:
    """XLA compiler options for a step program of `platform` under `train.cpu_matmul=setting`
    (one of CPU_MATMUL, checked with the config), for a model whose `attention_impl` is given."""
    use = platform == "cpu" and setting == "onednn" and attention_impl not in KEEPS_XLA_LIBRARIES
    return dict(_ONEDNN) if use else None


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


def jit(fun, setting: str, platform: str, attention_impl: str = "xla", **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` with the matmul library of `train.cpu_matmul=setting`
    (compiler_options); a oneDNN program is kept (keep)."""
    options = compiler_options(setting, platform, attention_impl)
    program = jax.jit(fun, compiler_options=options, **jit_kwargs)
    return keep(program) if options else program
