"""Strict JAX on 8 fake CPU devices, set before JAX initialises."""

import atexit
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
# XLA:CPU's LLVM code generation at -O0 in the test processes: compilation is ~60% of the suite's
# time, and a `tiny` train step compiles in 2.1-2.4 s at -O0 against 3.9-4.2 s by default
# (test_parity.py + test_pipeline.py: 472 -> 341 s; docs/performance.md, issue 19, twenty-third
# pass). The optimised HLO (sharding, partitioning, fusion, buffer assignment), which the
# in-process tests check, is the same at every level (checked: `tiny`'s train step, one device and
# fsdp=2,tensor=2); only the fused kernels' machine code is less optimised, and it rounds some
# results differently (contracted multiply-adds). So what must match users' runs bit for bit runs
# with the product's code generation: the CLI runs of the end-to-end tests (they drop XLA_FLAGS:
# test_cli.spmd_train and the like) and the pinned trajectories (run_fresh(product_codegen=True)).
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = f"{USER_XLA_FLAGS} --xla_backend_optimization_level=0".strip()
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import pytest  # noqa: E402
from runs import run_training  # noqa: E402 (tests import it from here)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 fake CPU devices"
    return devs


def run_fresh(code: str, devices: int = 1, product_codegen: bool = False) -> dict:
    """The JSON line that `code` prints last, run in a fresh process on `devices` CPU devices (with
    the project and tests/runs.py importable); `product_codegen`: without the suite's XLA flag
    (above)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    if product_codegen:
        env["XLA_FLAGS"] = USER_XLA_FLAGS
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_cfg():
    from spmd.config import load_config

    return load_config("tiny")


@pytest.fixture(scope="session")
def single_device_run(tiny_cfg):
    """10 steps of `tiny` on one device: the reference every parallel layout must match."""
    return run_training(tiny_cfg, "", "dp", 10, devices=jax.devices()[:1])
