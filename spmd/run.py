"""A training run in a run directory, as one library call: `train(setup, run_dir)`.

It owns the run directory's lifecycle: where the run starts (its own latest checkpoint, another
run's with `resume_from`, another checkpoint's parameters with `init_from`, else fresh), the
lock that keeps one trainer per directory, config.json and the tokenizer files, the loop and its
hooks (evaluation, metrics, progress, checkpoints, a profile), preemption, the hang watchdog and
the goodput ledger. `spmd-train` parses its flags, assembles the Setup (spmd.assembly.setup) and calls it;
tests and notebooks may call it in-process.

    setup = assemble("tiny", "fsdp=8", "fsdp")
    result = train(setup, pathlib.Path("runs/tiny"))   # rerun: resumes from the latest checkpoint
"""

import dataclasses
import json
import pathlib
import shutil
import time
from collections.abc import Sequence

import jax
import numpy as np

from spmd import start as start_lib
from spmd.analysis import oom
from spmd.assembly.config import config_from_json
from spmd.core.errors import UserError, log
from spmd.core.mesh import format_mesh
from spmd.data.chat import TEMPLATE_FILE
from spmd.data.loader import data_tokenizer, data_tokenizer_record
from spmd.data.tokenizer import run_file_name
from spmd.io import checkpoint as ckpt
from spmd.io import local_tier
from spmd.io.hf import TOKENIZER_FILES
from spmd.loop import goodput, runlock, spikes
from spmd.loop import train_loop as loop
from spmd.loop.metrics import MetricsWriteError, MetricsWriter, check_backends, peak_flops
from spmd.loop.watchdog import Watchdog
from spmd.parallel.sharding import fmt_bytes, tree_bytes_per_device
from spmd.platform import hostmem
from spmd.training.trainer import evaluate_all


@dataclasses.dataclass
class Result:
    """How a run ended: its directory, the last step done (the last committed checkpoint's when
    stopped by a signal), the metrics records this call logged (on process 0), and the signal that
    stopped it."""

    run_dir: pathlib.Path
    step: int
    metrics: list[dict]
    signal: int | None = None


def train(
    setup,
    run_dir: pathlib.Path,
    *,
    resume_from: str | None = None,
    init_from: str | dict | None = None,
    overwrite: bool = False,
    profile: tuple[int, int] | None = None,
    started: float | None = None,
    allow_tokenizer_change: bool = False,
    hooks: Sequence[loop.Hook] = (),
) -> Result:
    """Train `setup` (spmd.assembly.setup.assemble, with an optimizer) in `run_dir` up to train.steps.

    The run starts from `resume_from` (a run dir or one step) when given, else from run_dir's
    latest committed checkpoint, else from the parameters of `init_from` (a path, or
    `init_source`'s answer) with a fresh optimizer at step 0, else fresh from the seed.
    `overwrite`: clear run_dir first (its checkpoints too). `profile`: (A, B), a jax.profiler
    trace of steps A..B into run_dir/profile. `started`: when the process started (perf_counter),
    for the goodput ledger's init time (default: now). `allow_tokenizer_change`: start from a
    checkpoint trained with another tokenizer than the data's (else an error). `hooks`: side jobs
    of your own (spmd.loop.train_loop.Hook), run after the built-in ones on every process.
    Everything is validated before anything is written; bad input raises UserError."""
    started = time.perf_counter() if started is None else started
    run_dir = pathlib.Path(run_dir)
    if init_from is not None and resume_from:
        raise UserError("--init-from and --resume-from exclude each other: one starts fresh, one resumes")
    init = init_source(init_from) if isinstance(init_from, str) else init_from
    is_main = jax.process_index() == 0
    batches = setup.batches()
    tokenizer = data_tokenizer(setup.cfg.data)
    data_record = data_tokenizer_record(setup.cfg.data)
    tier, tier_notes = local_tier_of(setup.cfg.checkpoint, run_dir)
    start = start_lib.resume_or_init(
        setup.trainer, batches, run_dir, resume_from, overwrite, init["record"]["path"] if init else None,
        data_record, allow_tokenizer_change, tier,
    )  # fmt: skip
    start.notes[:0] = tier_notes
    check_precomputed_reference(setup.cfg, init["record"] if init else start.init_from)
    # Raw token ids say nothing of their tokenizer: the run keeps the one it started from.
    recorded = data_record or start.tokenizer
    if is_main:
        check_backends(setup.cfg.metrics)
    # Everything above validated the input; from here on we write, holding the run dir's lock.
    lock = runlock.acquire(run_dir)
    try:
        lost = prepare_run_dir(run_dir, start.step, overwrite, is_main)
        if tier is not None:
            tier.adopt(local_tier.run_id(run_dir), start.step)
        # where the weights came from, pinned: a fresh run's seed, or the checkpoint it started from
        origin = init["record"] if init else start.init_from or {"seed": setup.cfg.train.seed}
        resolved = describe_run(setup, batches, run_dir, start.notes, is_main, origin, recorded)
        if is_main:
            keep_tokenizer(tokenizer, run_dir)
        if init and is_main:
            copy_tokenizer(init["run_dir"], run_dir)
        return _loop(setup, batches, run_dir, start, resolved, is_main, profile, lost, started, hooks, tier)
    finally:
        lock.release()


def local_tier_of(cfg, run_dir: pathlib.Path):
    """(the run's local checkpoint tier or None, lines for the log); an error where it cannot work."""
    if not cfg.tiered:
        return None, []
    single = local_tier.LocalTier.check(cfg.local_dir, cfg.replicas, jax.process_count())
    tier = local_tier.LocalTier(cfg.local_dir, run_dir, cfg.replicas)
    tier.check_writable()
    copies = f", a copy on each of the next {cfg.replicas} process(es)" if cfg.replicas else ""
    return tier, [f"local checkpoints every {cfg.local_every} steps in {tier.base}{copies}", *single]


def check_precomputed_reference(cfg, origin: dict | None) -> None:
    """A DPO run on precomputed reference log-probabilities must start from the checkpoint that
    wrote them, on the data they were written for."""
    from spmd.data.loader import prepared_dir
    from spmd.data.preference import precomputed_reference, read_reference
    from spmd.data.prepare import read_manifest

    if not precomputed_reference(cfg):
        return
    directory = prepared_dir(cfg.data)
    record, _ = read_reference(directory, "data.path")
    if origin is None or origin.get("path") != record.get("checkpoint"):
        raise UserError(
            f"the reference log-probabilities beside {directory} were written by {record.get('checkpoint') or 'an unknown run'}, "
            f"but this run starts from {(origin or {}).get('path') or 'its seed'}: DPO's reference is the model a "
            f"run starts from; pass that checkpoint to --init-from, or write them again with spmd-eval --run-dir "
            f"<the --init-from run> --data {directory} --write-reference"
        )
    if record.get("data_key") != read_manifest(directory, check=False).get("key"):
        raise UserError(
            f"the reference log-probabilities beside {directory} were written for other data (it was prepared "
            f"again since); write them again with spmd-eval --write-reference"
        )


def held_out_note(cfg, batches) -> list[str]:
    """A warning line where evaluation would score the same held-out batch more than once."""
    distinct = batches.n_val_windows // batches.global_batch_size
    if not cfg.train.eval_every or batches.val_sources or cfg.train.eval_batches <= max(distinct, 1):
        return []
    return [
        f"warning: train.eval_batches = {cfg.train.eval_batches} but the held-out split holds {max(distinct, 1)} "
        f"distinct batch(es) of {batches.global_batch_size} x {batches.seq_len}: evaluation scores the same "
        f"windows repeatedly; lower train.eval_batches or hold out more data"
    ]


def init_source(path: str) -> dict:
    """Where a run that starts from another checkpoint's parameters (`--init-from`) takes them:
    its config (the new run's default), where it lies, and what the new run records of it
    (including the Hugging Face config it was imported from, for export)."""
    directory, step = ckpt.locate(path)
    meta = ckpt.check_meta(directory, step, ckpt.read_meta(directory, step), ("run",))
    run = meta["run"]
    # absolute: a run with frozen parameters finds them there again when resumed from another
    # working directory
    record = {
        "path": str((directory / str(step)).resolve()),
        "step": step,
        "digest": ckpt.params_digest(meta),
    }
    origin = run.get("hf") or run.get("init_from", {}).get("hf")
    if origin:
        record["hf"] = origin
    run_dir = ckpt.run_dir_of(directory)
    return {"config": config_from_json(run["config"]), "record": record, "run_dir": run_dir}


def keep_tokenizer(tokenizer, run_dir: pathlib.Path) -> None:
    """The data's tokenizer file goes into the run dir (tokenizer.json or tokenizer.model), where
    spmd-sample, spmd-eval and export-hf find it."""
    name = run_file_name(tokenizer)
    if name and tokenizer.file.resolve() != (run_dir / name).resolve():
        # chat data's template (spmd-data prepare keeps it beside the tokenizer) goes along
        for src, dst in ((tokenizer.file, name), (tokenizer.file.with_name(TEMPLATE_FILE), TEMPLATE_FILE)):
            if src.is_file():
                tmp = run_dir / f".{dst}.tmp"
                shutil.copy2(src, tmp)
                tmp.replace(run_dir / dst)


def copy_tokenizer(src: pathlib.Path, dst: pathlib.Path) -> None:
    """The tokenizer files of the run we start from travel with the new run (export takes them)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


# What a run writes into its directory before its first checkpoint commits: a directory holding
# only these is a run that started and never checkpointed (killed while compiling, say), and the
# same command starts it afresh instead of refusing it.
RUN_FILES = {
    "config.json",
    "metrics.jsonl",
    "metrics.jsonl.tmp",
    "tensorboard",
    "loss.png",
    "checkpoints",
    ".lock",
    "profile",
    "hangs",
    "wandb",  # a metrics backend's files, left by a start that failed to reach it
    "tracking.json",
    local_tier.RUN_ID,
    goodput.RESTORES,
}


def prepare_run_dir(
    run_dir: pathlib.Path, start_step: int, overwrite: bool, is_main: bool
) -> tuple[float, int]:
    """Make (or, with --overwrite, replace) the run directory; a resumed run's metrics.jsonl is cut
    back to the restored step, and a run that never checkpointed is started afresh (its logs
    cleared). Every process checks (the run dir is on a shared filesystem), so all fail alike;
    process 0 writes. Returns the seconds and steps an earlier attempt trained past `start_step`
    (lost to the restart; on process 0)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {str(run_dir)!r} is a file; give a directory")
    entries = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    never_checkpointed = not ckpt.committed_steps(run_dir / ckpt.SUBDIR)
    if entries and never_checkpointed and not overwrite and not entries <= RUN_FILES | set(TOKENIZER_FILES):
        raise UserError(
            f"run directory {str(run_dir)!r} already holds files but no checkpoints; pass a new --run-dir or --overwrite"
        )
    if is_main:
        try:
            if entries and overwrite:  # everything but the lock we hold
                log(f"--overwrite: deleting {what_is_in(run_dir)}")
                for path in run_dir.iterdir():
                    if path.name != runlock.LOCK:
                        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            elif entries and never_checkpointed and start_step == 0:
                for name in (
                    "tensorboard",
                    "loss.png",
                    "wandb",
                    "tracking.json",
                    goodput.RESTORES,
                ):  # the abandoned start's logs
                    path = run_dir / name
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"--run-dir {str(run_dir)!r} cannot be created or cleared: {e.strerror}"
            ) from None
        local_tier.run_id(run_dir, create=True)
        earlier = loop.trim_metrics(run_dir / "metrics.jsonl", start_step)
        lost = (goodput.lost_seconds(earlier, start_step), goodput.lost_steps(earlier, start_step))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("run directory ready")
    return lost if is_main else (0.0, 0)


def what_is_in(run_dir: pathlib.Path) -> str:
    """A run directory's contents in a line: its checkpoints' steps and the bytes of everything."""
    steps = ckpt.committed_steps(run_dir / ckpt.SUBDIR)
    n_bytes = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink())
    held = f"checkpoints at steps {', '.join(map(str, steps))}" if steps else "no checkpoints"
    return f"{run_dir}: {held}, {fmt_bytes(n_bytes)} in all"


def describe_run(
    setup, batches, run_dir: pathlib.Path, notes: list[str], is_main: bool, init_from: dict | None = None,
    tokenizer: dict | None = None,
) -> dict:  # fmt: skip
    """Write config.json (the fully resolved run) and log what will run; returns the resolved run.
    `init_from`: where --init-from took the parameters (kept with every checkpoint's metadata).
    `tokenizer`: what the run records of its tokenizer (spmd.data.tokenizer.record)."""
    cfg, plan = setup.cfg, setup.plan
    T, B = cfg.train.seq_len, cfg.train.global_batch_size
    figures = plan.family.figures(cfg.model, T)
    peak, peak_how = peak_flops(cfg.model.dtype, setup.choices.matmul)
    resolved = {
        **setup.to_json(),
        "model": {
            "family": plan.family.name,
            "params": figures.params,
            "flops_per_token": figures.flops_per_token,
        },
        "peak_flops": {"value": peak, "source": peak_how},
        "data": batches.description,
        **({"init_from": init_from} if init_from else {}),
        **({"tokenizer": tokenizer} if tokenizer is not None else {}),
    }
    if not is_main:
        return resolved
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    devices, n_proc = jax.devices(), jax.process_count()
    opt_bytes = tree_bytes_per_device(setup.trainer.abstract_state["opt_state"])
    lines = [
        f"config {cfg.name}: {plan.family.name}, {figures.params:,} params, {cfg.model.n_layers} layers, "
        f"compute {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}",
        f"attention: {setup.attention}",
        *([f"matmuls: {setup.choices.describe_matmul()}"] if setup.choices.platform == "cpu" else []),
        f"lowering: {setup.choices.lowering.describe()}",
        f"mesh: {format_mesh(setup.mesh.shape)} over {len(devices)} {devices[0].platform} devices "
        f"({n_proc} process{'es' if n_proc > 1 else ''}); rules: {setup.rules.name}",
        f"per device: params {fmt_bytes(plan.param_bytes_per_device)}, optimizer state {fmt_bytes(opt_bytes)}",
        *(
            [f"pipeline: {plan.schedule.describe()}; MFU counts model FLOPs, not idle stages"]
            if plan.schedule
            else []
        ),
        *filter(None, [plan.replication_warning()]),
        *(
            [
                f"gradients: summed as one vector per dtype over {', '.join(a for a in setup.trainer.flat_grad_axes if setup.mesh.shape[a] > 1)} "
                f"(cpu.grad_reduce={cfg.cpu.grad_reduce})"
            ]
            if setup.trainer.flat_grad_axes
            else []
        ),
        *(
            [f"sync: {cfg.sync.describe(bool(setup.requested.sync.axis_names()))}"]
            if cfg.sync.axis_names()
            else []
        ),
        *(
            [
                f"host heap: {hostmem.active()}, freed memory kept for the next step (cpu.host_heap={cfg.cpu.host_heap})"
            ]
            if hostmem.retained()
            else []
        ),
        *notes,
        f"data: {batches.description}; {batches.n_train_windows:,} training windows of {T} tokens",
        *held_out_note(cfg, batches),
        f"batch: {B} {'sequences' if B == cfg.train.sequences else f'preference pairs ({cfg.train.sequences} sequences)'} "
        f"x {T} tokens = {cfg.train.sequences * T:,} tokens/step in {cfg.train.microbatches} microbatch(es)",
        f"peak for MFU: {peak / 1e9:,.1f} GFLOP/s ({peak_how})",
    ]
    for line in lines:
        log(line)
    return resolved


def _loop(setup, batches, run_dir: pathlib.Path, start, resolved: dict, is_main: bool, profile,
          lost: tuple[float, int], started: float, extra_hooks=(), tier=None) -> Result:  # fmt: skip
    """Compile the step, then run the loop with its hooks from `start` to train.steps, watched
    (spmd.loop.watchdog) and accounted (spmd.loop.goodput)."""
    cfg, trainer = setup.cfg, setup.trainer
    tcfg = cfg.train
    if start.step >= tcfg.steps:
        if is_main:
            log(f"already at step {start.step} (train.steps = {tcfg.steps}): nothing to train")
        return Result(run_dir, start.step, [])
    ledger = goodput.Ledger(started, start.goodput)
    ledger.add("lost", lost[0])
    if start.restored is not None and is_main:
        r = start.restored
        ledger.restores = goodput.record_restore(run_dir, r["step"], r["tier"], lost[1], r["seconds"])
    elif is_main:
        ledger.restores = goodput.read_restores(run_dir)
    # The trackers start before the compile, so that one that cannot start costs no compile.
    writer = MetricsWriter(run_dir, cfg.metrics, resolved) if is_main else None
    t0 = time.perf_counter()
    ledger.add("init", t0 - started)
    guard = spikes.SpikeGuard.for_config(cfg.spikes, {"spikes": start.spikes})
    device = next(d for d in setup.mesh.devices.flat if d.process_index == jax.process_index())  # one of ours
    try:
        with oom.as_error("the train step", device):
            if cfg.spikes.action == "skip":  # the step takes the spike threshold as an input
                step_fn = (
                    trainer.guarded_step()
                    .lower(start.state, batches.train_batch(start.step), np.float32(np.inf))
                    .compile()
                )
            else:
                step_fn = trainer.train_step.lower(start.state, batches.train_batch(start.step)).compile()
        oom.check_fits(step_fn, "the train step", device)  # before it runs: nothing half done
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    compile_seconds = time.perf_counter() - t0
    ledger.add("compile", compile_seconds)
    if is_main:
        log(f"compiled train step in {compile_seconds:.1f}s")

    checkpointer = ckpt.Checkpointer(run_dir, cfg.checkpoint)
    hooks = [
        loop.EvalHook(
            tcfg.eval_every,
            lambda state: evaluate_all(
                trainer, trainer.model_params(state), batches, trainer.reference_params(state)
            ),
        )
    ]

    def meta(step: int) -> dict:  # what every tier saves with a step
        return ckpt.step_meta(step, batches, tcfg, resolved, ledger.totals(), guard.to_meta())

    metrics = None
    if is_main:
        metrics = loop.MetricsHook(
            tcfg.log_every, tcfg.eval_every, tcfg.global_batch_size * batches.rows_per_sample * tcfg.seq_len,
            resolved["model"]["flops_per_token"], resolved["peak_flops"]["value"], z_loss=bool(tcfg.z_loss),
            writer=writer, start_step=start.step, ledger=ledger,
        )  # fmt: skip
        hooks += [metrics, loop.ProgressHook(tcfg.log_every, tcfg.eval_every, tcfg.steps, start.step)]
    if tier is not None:  # after the record: a kill during the save loses a step that was logged
        hooks.append(loop.LocalCheckpointHook(tier, cfg.checkpoint, meta, setup.trainer.to_canonical))
    hooks.append(
        loop.CheckpointHook(
            checkpointer, cfg.checkpoint.every, meta, setup.trainer.to_canonical, cfg.checkpoint.continuous
        )
    )
    if profile is not None and is_main:
        hooks.append(loop.ProfileHook(run_dir / "profile", *profile, start.step))
    hooks.extend(extra_hooks)
    preemption = loop.Preemption().install()
    watchdog = Watchdog(tcfg.step_timeout, run_dir / "hangs", jax.process_index(), compile_seconds)

    def rollback(spike: spikes.Rollback):
        """The state of the newest checkpoint before the spike, the data past the batches that led
        to it (spmd.loop.spikes.roll_back)."""
        checkpointer.wait()
        state, meta, target, skip = spikes.roll_back(
            spike, guard, cfg.spikes, tcfg.global_batch_size, batches, ckpt.committed_steps(checkpointer.directory),
            lambda step: ckpt.restore(checkpointer.directory, step, trainer.abstract_saved),
        )  # fmt: skip
        if is_main:
            log(f"rollback: loss spike at step {spike.step} (loss {spike.loss:.4f}, above {spike.threshold:.4f}); "
                f"restored step {target} and skipped {skip} batches of data (rollback {guard.rollbacks} of at "
                f"most {cfg.spikes.max_rollbacks})")  # fmt: skip
        if tier is not None:
            tier.discard_after(target)
        return trainer.from_canonical(state, ckpt.unsaved_of(trainer, meta, "the rollback")), target

    train_loop = loop.TrainLoop(
        step_fn, batches, hooks, stop=preemption.requested, max_skipped=tcfg.max_skipped_steps, ledger=ledger,
        watchdog=watchdog, guard=guard, on_rollback=rollback,
    )  # fmt: skip
    try:
        with oom.as_error("the train step", device):
            train_loop.run(start.state, start.step, tcfg.steps)
    except MetricsWriteError as e:
        raise MetricsWriteError(f"{e}; {ckpt.kept_checkpoints(checkpointer.directory)}") from None

    history = [r for r in metrics.history if r["step"] > start.step] if metrics is not None else []
    if preemption.signal is not None:
        if is_main:
            log(f"stopped by signal {preemption.signal}: checkpoint for step {checkpointer.last_saved} committed "
                f"in {checkpointer.directory}; {goodput.summary(ledger.totals(), ledger.restores)}")  # fmt: skip
        return Result(run_dir, checkpointer.last_saved, history, preemption.signal)
    if history:
        last = history[-1]
        evals = [r["eval_loss"] for r in history if "eval_loss" in r]
        log(f"done: step {last['step']}, loss {last['loss']:.4f}" + (f", eval loss {evals[-1]:.4f}" if evals else "")
            + f"; {goodput.summary(ledger.totals(), ledger.restores)}; run dir {run_dir}")  # fmt: skip
    if is_main and train_loop.skipped:
        log(f"warning: {train_loop.skipped} of {tcfg.steps - start.step} steps had a non-finite loss or gradient "
            f"norm and were skipped (the state unchanged)"
            + ("; train.max_skipped_steps = 0 lets a run skip every step" if not tcfg.max_skipped_steps else ""))  # fmt: skip
    return Result(run_dir, tcfg.steps, history)
