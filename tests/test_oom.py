"""Out of device memory (spmd.analysis.oom): a step that cannot fit is an error naming what it needs, what
the device has and the levers, before it runs (the compile-time check) and when an allocation fails
while it runs, with the committed checkpoints intact. A CPU host reports no memory limit, so the
device's limit is set here."""

import jax
import pytest

from spmd import run
from spmd.analysis import oom
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.data import loader as data_lib
from spmd.io import checkpoint as ckpt

OVERRIDES = ["train.steps=4", "train.log_every=1", "train.eval_every=0", "checkpoint.every=2",
             "checkpoint.async_save=false"]  # fmt: skip


def setup(devices):
    return assemble(load_config("tiny", OVERRIDES), "fsdp=2", "fsdp", devices=devices[:2])


def test_a_step_over_the_devices_memory_is_refused_before_it_runs(tmp_path, devices, monkeypatch):
    monkeypatch.setattr(oom, "device_limit", lambda device: 64 * 1024)
    with pytest.raises(oom.OutOfMemory) as caught:
        run.train(setup(devices), tmp_path)
    text = str(caught.value)
    assert "the train step needs " in text and "per device but cpu has 64.00 KiB" in text
    assert "model.remat=full" in text and "train.microbatches=N" in text
    assert ckpt.committed_steps(tmp_path / ckpt.SUBDIR) == []


def test_an_allocation_that_fails_while_training_is_an_error(tmp_path, devices, monkeypatch):
    train_batch = data_lib.Batches.train_batch

    def failing(self, step):
        if step == 3:  # as XLA:GPU says it when an allocation of the step fails
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes."
            )
        return train_batch(self, step)

    monkeypatch.setattr(data_lib.Batches, "train_batch", failing)
    with pytest.raises(
        oom.OutOfMemory, match=r"the train step ran out of device memory \(an allocation of 1.00 GiB failed"
    ):
        run.train(setup(devices), tmp_path)
    assert ckpt.committed_steps(tmp_path / ckpt.SUBDIR) == [2]  # what was committed stays whole


def test_the_sizes_xla_names():
    tpu = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 98.31G of 95.74G hbm."
    need, failed = oom._sizes(tpu)
    assert failed is None and need == int(98.31 * 1024**3)
    assert oom._sizes("Out of memory while trying to allocate 2048 bytes") == (None, 2048)
    with pytest.raises(ValueError):
        with oom.as_error("x"):
            raise ValueError("not memory")
