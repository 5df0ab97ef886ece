"""Strict JAX on 8 fake CPU devices, set before JAX initialises."""

import atexit
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# One persistent compilation cache for the session, shared with the subprocesses (CLI, launcher):
# many tests compile the very same `tiny` programs; XLA then compiles each once. Fresh per session,
# so it never outlives the code it was compiled from. (About a quarter off test_checkpoint.py +
# test_optimizers.py: 3:06 -> 2:16 on this 2-core machine, starting from an empty cache.)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd-test-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src import compiler as jax_compiler  # noqa: E402 (its compile options: below)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)

# The CPU programs the test processes compile themselves get XLA:CPU's LLVM code generation at -O0:
# compilation is most of the suite's time, and -O0 compiles faster (the suite's time:
# docs/performance.md). The level is LLVM's, for the fused kernels'
# machine code; the optimised HLO (sharding, partitioning, fusion, buffer assignment), which the
# in-process tests check, is the same at every level. Only the
# machine code rounds some results differently (multiply-adds not contracted), so what must match
# users' runs bit for bit compiles as theirs do: the pinned trajectories (`product_codegen()`) and
# every subprocess (CLI runs, launchers, run_fresh), which this process-local switch does not reach.
# Per program (a compiler option, as jit's `compiler_options` sets one), not XLA_FLAGS: XLA_FLAGS
# would reach the subprocesses too, and is read once per process.
SUITE_CODEGEN = {"xla_backend_optimization_level": 0}
_codegen = {"product": False}
_jax_get_compile_options = jax_compiler.get_compile_options


def _get_compile_options(*args, env_options_overrides=None, backend=None, **kwargs):
    cpu = backend is None or backend.platform == "cpu"  # TPU dry-runs compile as they would on TPU
    if cpu and not _codegen["product"]:
        env_options_overrides = SUITE_CODEGEN | (env_options_overrides or {})
    return _jax_get_compile_options(
        *args, env_options_overrides=env_options_overrides, backend=backend, **kwargs
    )


jax_compiler.get_compile_options = _get_compile_options


@contextlib.contextmanager
def product_codegen():
    """Compile the CPU programs built inside the block with users' code generation (above)."""
    before, _codegen["product"] = _codegen["product"], True
    try:
        yield
    finally:
        _codegen["product"] = before


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 fake CPU devices"
    return devs


def run_training(cfg, mesh_spec: str, rules_name: str, steps: int, devices=None):
    """Train `steps` steps in-process; return (losses, params as host numpy, trainer)."""
    from spmd.assembly.setup import assemble

    setup = assemble(cfg, mesh_spec, rules_name, devices=devices)
    trainer, batches = setup.trainer, setup.batches()
    state = trainer.init_state()
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, jax.device_get(state["params"]))
    return np.array(losses), params, trainer


def run_fresh(code: str) -> dict:
    """The JSON line that `code` prints last, run in a fresh process on one CPU device (with the
    project importable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_cfg():
    from spmd.assembly.config import load_config

    return load_config("tiny")


@pytest.fixture(scope="session")
def single_device_run(tiny_cfg):
    """10 steps of `tiny` on one device: the reference every parallel layout must match (with users'
    code generation: test_pinned.py compares it bit for bit)."""
    with product_codegen():
        return run_training(tiny_cfg, "", "dp", 10, devices=jax.devices()[:1])
