"""Where a run starts: resumed from its own (or a named) checkpoint, fine-tuned from another run's
weights (`--init-from`), or fresh from the seed. Reads only, so an error leaves the run
directory as it was."""

import dataclasses
import pathlib
import time

import jax

from spmd.core.errors import UserError
from spmd.data.tokenizer import check_agrees
from spmd.io.checkpoint import (
    SUBDIR,
    check_meta,
    committed_steps,
    locate,
    read_meta,
    restore,
    restore_weights,
    uncommitted,
    unsaved_of,
)


@dataclasses.dataclass
class Start:
    """Where a run starts: its state, the step it has done, and lines for the log."""

    state: dict
    step: int
    notes: list[str]
    goodput: dict = dataclasses.field(default_factory=dict)  # the restored step's ledger (spmd.loop.goodput)
    tokenizer: dict | None = None  # what the checkpoint it came from recorded of its tokenizer
    spikes: dict = dataclasses.field(
        default_factory=dict
    )  # the restored step's loss history (spmd.loop.spikes)
    # where the run's weights first came from (--init-from's record), kept across resumes: what its
    # frozen parameters are, and the Hugging Face origin export writes back to
    init_from: dict | None = None
    # where the state came from: {"tier": storage | local | peer, "step", "seconds" it took}
    restored: dict | None = None


def resume_or_init(
    trainer,
    batches,
    run_dir: pathlib.Path,
    resume_from: str | None = None,
    overwrite: bool = False,
    init_from: str | None = None,
    tokenizer: dict | None = None,
    allow_tokenizer_change: bool = False,
    local=None,
):
    """The run's starting state: restored from `resume_from` (a run dir or one step) when given,
    else from `run_dir`'s latest committed checkpoint (unless `overwrite`), else the parameters of
    `init_from` with a fresh optimizer at step 0 (a fine-tune; once it has checkpointed, a restart
    resumes from its own checkpoints), else fresh from the seed. `tokenizer`: what the data's
    tokenizer is (spmd.data.loader.data_tokenizer_record); a checkpoint trained with another is an error
    unless `allow_tokenizer_change`.

    `local` (spmd.io.local_tier.LocalTier): the run's local tier, restored from instead of
    storage when it holds a newer complete step (not with `resume_from` or `overwrite`).

    Resuming also moves `batches` to the checkpoint's data position. Reads only, so that any error
    here leaves the run directory as it was.
    """
    cfg = trainer.cfg
    own = run_dir / SUBDIR
    notes, source = [], None
    if resume_from:
        source = locate(resume_from)
    elif not overwrite and own.is_dir():
        steps = committed_steps(own)
        if steps:
            source = (own, steps[-1])
        elif uncommitted(own):
            notes.append(
                f"warning: {own} holds only uncommitted checkpoints ({', '.join(uncommitted(own))}) "
                f"from an interrupted save; removing them"
            )
    t0 = time.perf_counter()
    local_step = None
    if local is not None and not resume_from and not overwrite:
        local_step = local.restore(trainer.abstract_saved, source[1] if source else -1, notes)
    if local_step is not None:
        directory, step, state, meta = local.root / "own", local_step.step, local_step.state, local_step.meta
        check_agrees(meta.get("run", {}).get("tokenizer"), tokenizer, f"local checkpoint {directory}/{step}",
                     allow_tokenizer_change)  # fmt: skip
        check_resumable(cfg, directory, step, meta)
        tier = local_step.source
    elif source is None and init_from:
        return _fine_tune(trainer, init_from, tokenizer, allow_tokenizer_change, notes)
    elif source is None:
        return Start(trainer.init_state(), 0, notes)
    else:
        directory, step = source
        meta = check_meta(
            directory, step, read_meta(directory, step), ("consumed_samples", "global_batch_size")
        )
        check_agrees(meta.get("run", {}).get("tokenizer"), tokenizer, f"checkpoint {directory}/{step}",
                     allow_tokenizer_change)  # fmt: skip
        check_resumable(cfg, directory, step, meta)
        state, meta = restore(directory, step, trainer.abstract_saved)
        tier = "storage"
    # checkpoints hold the canonical layer order, without the frozen parameters and the reference
    # model (the weights the run started from)
    state = trainer.from_canonical(state, unsaved_of(trainer, meta, f"checkpoint {directory}/{step}"))
    saved_batch, consumed = int(meta["global_batch_size"]), int(meta["consumed_samples"])
    batches.resume_at(step, consumed)
    if tier == "storage":
        notes.append(f"resumed from {directory}/{step}: step {step}, {consumed:,} samples consumed")
    else:
        peers = "; ".join(
            f"process {o}'s shards from process {h}'s copy" for o, h in sorted(local_step.peers.items())
        )
        notes.append(
            f"resumed from the local tier ({local.base}) at step {step}: {consumed:,} samples consumed"
            + (f"; {peers}" if peers else "")
        )
    if saved_batch != cfg.train.global_batch_size:
        notes.append(
            f"warning: global batch size changed from {saved_batch} to {cfg.train.global_batch_size}: data continues "
            f"at sample {consumed:,} (nothing skipped or repeated), the step count and learning-rate schedule "
            f"continue from step {step}, so each later step sees {cfg.train.global_batch_size} sequences"
        )
    for key, now in (("seq_len", cfg.train.seq_len), ("seed", cfg.train.seed)):
        if int(meta.get(key, now)) != now:
            notes.append(
                f"warning: train.{key} was {meta[key]} when the checkpoint was written and is {now} now; "
                f"the data order after the restore differs from the original run's"
            )
    ledger = meta.get("goodput")
    return Start(
        state, step, notes, ledger if isinstance(ledger, dict) else {}, meta.get("run", {}).get("tokenizer"),
        meta.get("spikes") if isinstance(meta.get("spikes"), dict) else {}, pinned_origin(meta),
        {"tier": tier, "step": step, "seconds": time.perf_counter() - t0},
    )  # fmt: skip


def _fine_tune(trainer, init_from: str, tokenizer, allow_tokenizer_change: bool, notes: list[str]) -> Start:
    """Another checkpoint's weights with a fresh optimizer at step 0 (`--init-from`)."""
    directory, step = locate(init_from)
    params, meta = restore_weights(directory, step, trainer.abstract_weights, trainer.fresh_weights)
    check_agrees(meta.get("run", {}).get("tokenizer"), tokenizer, f"checkpoint {directory}/{step}",
                 allow_tokenizer_change)  # fmt: skip
    # without the parameters a transform adds (state_from_params adds them)
    params = trainer.plan.from_canonical(params, jax.tree.map(lambda x: x.sharding, params))
    notes.append(f"parameters from {directory}/{step}; fresh optimizer state, starting at step 0")
    return Start(trainer.state_from_params(params), 0, notes, tokenizer=meta.get("run", {}).get("tokenizer"))


def check_resumable(cfg, directory: pathlib.Path, step: int, meta: dict) -> None:
    """An error where a checkpoint's state cannot continue under this config: it holds parameters
    only, or optimizer state of another optimizer."""
    if meta.get("params_only"):
        raise UserError(
            f"checkpoint {directory}/{step} holds parameters only (e.g. from spmd-ckpt import-hf), no optimizer "
            f"state to resume; start from it with --init-from {directory.parent} and a new --run-dir"
        )
    saved_opt = {"name": "adamw", "state_dtype": "float32"} | (
        meta.get("run", {}).get("config", {}).get("optimizer") or {}
    )
    for key in ("name", "state_dtype"):
        if saved_opt.get(key) != getattr(cfg.optimizer, key):
            raise UserError(
                f"checkpoint {directory}/{step} was trained with optimizer.{key} = {saved_opt.get(key)!r}, this "
                f"run asks for {getattr(cfg.optimizer, key)!r}; its optimizer state cannot continue under another, so "
                f"keep {saved_opt.get(key)!r}, or start from its parameters with --init-from and a new --run-dir"
            )


def pinned_origin(meta: dict) -> dict:
    """Where a checkpoint's run took its starting weights, as later checkpoints of it keep saying:
    its `init_from` record, or the seed it started with (older records: its config's)."""
    run = meta.get("run", {})
    return run.get("init_from") or {"seed": int(run.get("config", {}).get("train", {}).get("seed", 0))}
