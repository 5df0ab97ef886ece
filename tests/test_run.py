"""A training run in a run directory as one library call (spmd.run.train), in-process: the same
losses as stepping the trainer by hand, its files, and a second call that resumes."""

import json

import pytest
from conftest import run_training

from spmd import run
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.io import checkpoint as ckpt

OVERRIDES = ["train.log_every=2", "train.eval_every=0", "checkpoint.every=2", "checkpoint.async_save=false"]


def test_train_owns_the_run_dir_and_resumes_where_it_stopped(tmp_path, devices):
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=4"])
    run_dir = tmp_path / "run"
    first = run.train(assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), run_dir)
    assert (first.step, first.signal, [r["step"] for r in first.metrics]) == (4, None, [2, 4])
    by_hand, _, _ = run_training(cfg, "fsdp=2", "fsdp", 4, devices=devices[:2])
    assert [r["loss"] for r in first.metrics] == [float(by_hand[1]), float(by_hand[3])]
    assert ckpt.committed_steps(run_dir / ckpt.SUBDIR) == [2, 4]
    recorded = json.loads((run_dir / "config.json").read_text())
    assert (
        recorded["config"]["model"]["family"] == "llama" and recorded["resolved"]["attention_impl"] == "xla"
    )
    assert recorded["model"]["params"] == cfg.model_family.figures(cfg.model, cfg.train.seq_len).params

    longer = assemble(
        load_config("tiny", [*OVERRIDES, "train.steps=6"]), "fsdp=2", "fsdp", devices=devices[:2]
    )
    second = run.train(longer, run_dir)
    assert second.step == 6 and [r["step"] for r in second.metrics] == [6]
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2, 4, 6]

    done = run.train(longer, run_dir)  # nothing left to do: no step, no write
    assert (done.step, done.metrics) == (6, [])
    with pytest.raises(UserError, match="exclude each other"):
        run.train(longer, tmp_path / "other", resume_from=str(run_dir), init_from=str(run_dir))


def test_overwrite_says_what_it_deletes(tmp_path, devices, capsys):
    """Rerunning resumes; --overwrite starts afresh, and first says which checkpoints it deletes."""
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=2"])
    setup = assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2])
    run.train(setup, tmp_path / "run")
    capsys.readouterr()
    again = run.train(setup, tmp_path / "run", overwrite=True)
    err = capsys.readouterr().err
    assert again.step == 2 and f"--overwrite: deleting {tmp_path / 'run'}: checkpoints at steps 2, " in err


def test_resuming_under_other_optimizer_settings_names_them(tmp_path, devices):
    """Without clipping the optimizer state has another layout: the error says it is the optimizer's
    settings, not the model's, and how to go on."""
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=2"])
    run.train(assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "run")
    unclipped = load_config("tiny", [*OVERRIDES, "train.steps=4", "optimizer.grad_clip=0"])
    with pytest.raises(UserError, match=r"other optimizer settings .*grad_clip on or off.*--init-from"):
        run.train(assemble(unclipped, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "run")


def test_a_run_that_skipped_steps_says_so_at_the_end(tmp_path, devices, capsys):
    """With train.max_skipped_steps = 0 a run may skip every step after the first (a learning rate
    that overflows the parameters); it ends with a warning counting them, not a plain `done`."""
    blowup = ["optimizer.learning_rate=1e38", "optimizer.warmup_steps=0", "optimizer.grad_clip=0"]
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=4", "train.max_skipped_steps=0", *blowup])
    result = run.train(assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "run")
    assert result.metrics[-1]["skipped_steps"] == 3
    assert (
        "warning: 3 of 4 steps had a non-finite loss or gradient norm and were skipped"
        in capsys.readouterr().err
    )


def test_a_hook_of_ones_own_runs_on_its_schedule_through_the_public_names(tmp_path, devices):
    """`spmd.train(..., hooks=[...])`: a side job of one's own (spmd.Hook) sees the steps its
    `every` asks for and the final one, with the step's metrics and state."""
    import spmd

    class Record(spmd.Hook):
        every = 2

        def __init__(self):
            self.seen = []

        def __call__(self, info: spmd.StepInfo) -> None:
            self.seen.append((info.step, info.final, round(float(info.metrics["loss"]), 6)))

    hook = Record()
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=5", "checkpoint.every=0"])
    result = spmd.train(
        spmd.assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "run", hooks=[hook]
    )
    assert isinstance(result, spmd.Result) and result.step == 5
    assert [(s, f) for s, f, _ in hook.seen] == [(2, False), (4, False), (5, True)]
    by_step = {r["step"]: r["loss"] for r in result.metrics}
    assert hook.seen[1][2] == round(by_step[4], 6)


def test_the_library_page_runs_as_written(tmp_path, devices, monkeypatch):
    """docs/library.md's example, executed in a fresh directory."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "library.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", page, re.S)[:1]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(example, "docs/library.md", "exec"), namespace)  # noqa: S102
    assert namespace["result"].step == namespace["setup"].cfg.train.steps
    assert (tmp_path / "runs" / "library" / "metrics.jsonl").is_file()
