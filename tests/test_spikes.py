"""Loss spikes (spmd.loop.spikes): the robust test, the three answers to a spike (stop, skip, rollback)
on a real run whose data holds one corrupt batch, retention that keeps the checkpoint from before
the first spike and the best one by eval loss, and a rollback that resumes to the same losses
wherever it is killed."""

import json
import math
import statistics

import numpy as np
import pytest

from spmd import run
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.data import loader as data_lib
from spmd.io import checkpoint as ckpt
from spmd.loop import spikes
from spmd.loop import train_loop as loop
from spmd.training import trainer as trainer_lib

BAD_STEP = 29  # the step whose batch is corrupt (it reports its loss as step 29)
OVERRIDES = [
    "train.steps=36",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=4",
    "checkpoint.async_save=false",
    "spikes.window=16",
]


def guard(on_spike="stop", factor=6.0, window=16):
    return spikes.SpikeGuard.for_config(load_config("tiny", [f"spikes.action={on_spike}",
        f"spikes.factor={factor}", f"spikes.window={window}"]).spikes)  # fmt: skip


def test_a_falling_noisy_loss_is_no_spike_and_a_jump_is():
    rng = np.random.default_rng(0)
    g = guard()
    for step in range(1, 200):  # a loss that falls fast, then slowly, with 3% noise
        g.observe(step, (2 + 3.5 * math.exp(-step / 20)) * (1 + 0.03 * rng.standard_normal()), skipped=False)
    assert g.spikes == 0 and g.first_anomaly is None
    with pytest.raises(spikes.Spiked, match=r"loss spike at step 200: loss 4\.0000 is above 2\.\d+"):
        g.observe(200, 4.0, skipped=False)
    assert (g.spikes, g.first_anomaly) == (1, 200)

    rollback = guard("rollback")
    for step in range(1, 40):
        rollback.observe(step, 3.0 + 0.01 * (step % 3), skipped=False)
    with pytest.raises(spikes.Rollback) as caught:
        rollback.observe(40, 3.5, skipped=False)
    assert caught.value.step == 40 and 3.0 < caught.value.threshold < 3.5


def test_a_young_run_is_judged_by_the_phase_it_is_in():
    """A run 31 steps old whose loss fell from 5.6 to 3.3: a jump back to 5.14 is a spike, though
    the whole window (holding the first fall) would let it pass."""
    g = guard()
    fall = [3.3 + 2.3 * (math.exp(-t / 10) - math.exp(-3)) / (1 - math.exp(-3)) for t in range(31)]
    for step, loss in enumerate(fall, start=1):
        g.observe(step, loss, skipped=False)
    whole = statistics.median(fall) + 6 * 1.4826 * statistics.median(
        abs(x - statistics.median(fall)) for x in fall
    )
    assert whole > 5.14  # the old test, over the whole window
    assert g.last_healthy and not g.healthy(5.14)
    with pytest.raises(spikes.Spiked, match="loss spike at step 32: loss 5.1400"):
        g.observe(32, 5.14, skipped=False)


def test_retention_keeps_the_newest_healthy_checkpoint_of_a_climbing_loss(tmp_path):
    cfg = load_config("tiny", ["checkpoint.keep_last=2", "checkpoint.keep_every=0", "checkpoint.keep_best=0"])
    keeper = ckpt.Checkpointer(tmp_path, cfg.checkpoint)
    g = guard(window=64)
    steps = list(range(1, 37))
    for step in steps:  # noisy but level until 31, then a climb no single step of which is a spike
        g.observe(
            step, 3.3 + 0.1 * ((step * 7) % 3 - 1) if step <= 31 else 3.3 + 0.12 * (step - 31), skipped=False
        )
        keeper.note(step, {"spikes": g.to_meta()})
    assert g.spikes == 0 and not g.last_healthy
    assert keeper.keep(steps) == {34, 35, 36}  # 34: the newest step within 3 spreads of the level
    keeper.close()


def test_the_test_waits_to_settle_and_travels_with_checkpoints():
    g = guard()
    for step in range(1, spikes.SETTLE + 1):
        assert g.threshold() == math.inf  # unjudged: too few losses to know the noise
        g.observe(step, 10.0**step, skipped=False)
    assert g.threshold() < math.inf and g.spikes == 0
    g.observe(spikes.SETTLE + 1, math.nan, skipped=True)  # non-finite: the first anomaly, no spike
    assert g.first_anomaly == spikes.SETTLE + 1 and g.spikes == 0
    again = spikes.SpikeGuard.for_config(
        load_config("tiny", ["spikes.window=16"]).spikes, {"spikes": g.to_meta()}
    )
    assert again.threshold() == g.threshold() and again.first_anomaly == g.first_anomaly
    assert guard(factor=0).threshold() == math.inf


def test_retention_keeps_the_newest_before_the_first_anomaly_and_the_best(tmp_path):
    cfg = load_config("tiny", ["checkpoint.keep_last=2", "checkpoint.keep_every=0", "checkpoint.keep_best=1"])
    keeper = ckpt.Checkpointer(tmp_path, cfg.checkpoint)
    steps = [4, 8, 12, 16, 20, 24]
    assert keeper.keep(steps) == {20, 24}
    keeper.eval_losses = {8: 2.5, 16: 2.1, 24: 2.4}
    keeper.first_anomaly = 14
    assert keeper.keep(steps) == {12, 16, 20, 24}  # 12: before the anomaly; 16: best eval loss
    keeper.close()


@pytest.fixture
def corrupt_batch(monkeypatch):
    """The training batch of step BAD_STEP, at its place in the sample stream, is one byte repeated:
    a data-borne spike that skipping the batch cures."""
    assemble_batch = data_lib.Batches._assemble
    bad_sample = (BAD_STEP - 1) * load_config("tiny").train.global_batch_size

    class Repeated:
        def __init__(self, dataset):
            self.dataset = dataset

        def __getitem__(self, i):
            return np.full_like(self.dataset[i], 255)

    def poisoned(self, dataset, first):
        if dataset is self.train and first == bad_sample:
            dataset = Repeated(dataset)
        return assemble_batch(self, dataset, first)

    monkeypatch.setattr(data_lib.Batches, "_assemble", poisoned)


def train(run_dir, devices, *extra):
    cfg = load_config("tiny", [*OVERRIDES, *extra])
    return run.train(assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), run_dir)


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records]


def test_stop_is_an_error_that_keeps_every_checkpoint_before_the_spike(corrupt_batch, tmp_path, devices):
    with pytest.raises(spikes.Spiked, match=f"loss spike at step {BAD_STEP}: .*spikes.action = stop"):
        train(tmp_path, devices)
    assert ckpt.committed_steps(tmp_path / ckpt.SUBDIR) == [20, 24, 28]
    assert [s for s, _ in losses(tmp_path)] == list(range(1, BAD_STEP))  # the spike is not logged


def test_skip_leaves_the_state_unchanged_and_keeps_the_checkpoint_before_it(corrupt_batch, tmp_path, devices):
    result = train(
        tmp_path, devices, "spikes.action=skip", "checkpoint.keep_last=1", "checkpoint.keep_best=0"
    )
    assert result.step == 36
    spiked = result.metrics[BAD_STEP - 1]
    assert spiked["step"] == BAD_STEP and spiked["loss"] > 6 and spiked["skipped_steps"] == 1
    assert (result.metrics[-1]["spikes"], result.metrics[-1]["skipped_steps"]) == (1, 1)
    # keep_last = 1, and yet step 28 stays: the newest checkpoint from before the first spike
    assert ckpt.committed_steps(tmp_path / ckpt.SUBDIR) == [28, 36]
    assert ckpt.read_meta(tmp_path / ckpt.SUBDIR, 36)["spikes"]["first_anomaly"] == BAD_STEP


def test_rollback_skips_the_batch_and_resumes_to_the_same_losses_wherever_killed(
    corrupt_batch, tmp_path, devices, monkeypatch, capsys
):
    settings = ("spikes.action=rollback", "spikes.skip_batches=1")
    whole = train(tmp_path / "whole", devices, *settings)
    assert whole.step == 36 and (whole.metrics[-1]["spikes"], whole.metrics[-1]["rollbacks"]) == (1, 1)
    assert f"rollback: loss spike at step {BAD_STEP} " in capsys.readouterr().err
    want = losses(tmp_path / "whole")
    assert [s for s, _ in want] == list(range(1, 37))  # rewound: one record per step
    assert max(loss for _, loss in want) < 6  # the corrupt batch's loss is not the one kept for its step
    assert 28 in ckpt.committed_steps(tmp_path / "whole" / ckpt.SUBDIR)

    def killed_in(name, method, when):
        """Runs to where `method` of the hook class `name` is called and `when(args)` holds, then
        dies there (as kill -9 would: no save, no cleanup beyond the hooks' close), and reruns."""
        original = getattr(getattr(loop, name), method)

        def dying(self, *args):
            original(self, *args)
            if when(*args):
                raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(getattr(loop, name), method, dying)
            with pytest.raises(KeyboardInterrupt):
                train(tmp_path / name, devices, *settings)
        return train(tmp_path / name, devices, *settings)

    # just after the rollback, before any later checkpoint: the rerun replays from step 28
    replayed = killed_in("MetricsHook", "rewind", lambda step, seconds: True)
    assert replayed.metrics[0]["step"] == 29 and losses(tmp_path / "MetricsHook") == want
    # just after a checkpoint that follows the rollback: it carries the data position and counts
    again = killed_in("CheckpointHook", "__call__", lambda info: info.step == 32)
    assert [r["step"] for r in again.metrics] == [33, 34, 35, 36] and again.metrics[-1]["rollbacks"] == 1
    assert losses(tmp_path / "CheckpointHook") == want


def test_rollbacks_are_capped(corrupt_batch, tmp_path, devices):
    with pytest.raises(spikes.Spiked, match=r"after 0 rollbacks \(spikes.max_rollbacks\)"):
        train(tmp_path, devices, "spikes.action=rollback", "spikes.max_rollbacks=0")
    assert ckpt.committed_steps(tmp_path / ckpt.SUBDIR) == [20, 24, 28]


def test_the_spike_keys_have_their_own_table():
    """[spikes] holds what was train.spike_*: the old keys are an error naming the new ones, and a
    config saved with them (a checkpoint of an older version) reads them into the table."""
    from spmd.assembly.config import config_from_json
    from spmd.core.errors import UserError

    with pytest.raises(UserError, match=r"'train.on_spike' .*has moved: it is 'spikes.action' now"):
        load_config("tiny", ["train.on_spike=skip"])
    saved = load_config("tiny").to_json()
    old = {k: v for k, v in saved.items() if k != "spikes"}
    old["train"] = {**saved["train"], "on_spike": "rollback", "spike_window": 16, "max_rollbacks": 1}
    spikes_cfg = config_from_json(old).spikes
    assert (spikes_cfg.action, spikes_cfg.window, spikes_cfg.max_rollbacks) == ("rollback", 16, 1)


def test_an_eval_over_no_counted_token_is_an_error_not_a_best():
    """Held-out batches whose masks count nothing would score 0.0, which retention would keep as
    the best checkpoint."""

    class Batches:
        val_sources = {}

        def eval_batch(self, i):
            return {}

    with pytest.raises(UserError, match="the held-out split counts no token in 2 batch"):
        trainer_lib.held_out_by_source(lambda params, batch: (0.0, 0.0), None, Batches(), 2)
    assert trainer_lib.held_out_by_source(lambda params, batch: (3.0, 2.0), None, Batches(), 2)[:2] == (
        6.0,
        4.0,
    )
