"""`spmd-train`: train a model from a config preset, a mesh shape and a sharding-rules file."""

import argparse
import json
import os
import pathlib
import shutil
import sys
import time

EPILOG = """
examples:
  spmd-train --config small --mesh fsdp=8 --rules fsdp --host-devices 8 --run-dir runs/quickstart
  spmd-train --config tiny --mesh data=2,fsdp=2,tensor=2 --rules fsdp_tp --host-devices 8 --steps 20
  spmd-train --config llama-8b --mesh fsdp=-1,tensor=4 --rules fsdp_tp --host-devices 64 --print-sharding
  spmd-train --config tiny --set train.learning_rate=1e-3 --set model.remat=full

mesh axes: data, fsdp, context, expert, tensor (unnamed axes are 1; one size may be -1 = fill).
Config keys are listed in README.md ("Config keys"); --set takes section.key=value.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line and exit 2, like every other bad input
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="spmd-train",
        description="Train a sharded transformer. The mesh comes from --mesh; how each parameter and "
        "activation is split over it comes from the --rules file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        default="small",
        help="config preset in configs/ (tiny, small, llama-1b, ...) or a .toml path [small]",
    )
    p.add_argument(
        "--mesh",
        default="fsdp=-1",
        help="mesh shape, e.g. data=2,fsdp=2,tensor=2; must multiply to the device count [fsdp=-1]",
    )
    p.add_argument(
        "--dcn-mesh",
        default="",
        help="mesh across processes (multi-host), e.g. data=2; then --mesh is per process",
    )
    p.add_argument(
        "--rules",
        default="fsdp",
        help="sharding rules: a preset in sharding_rules/ (dp, fsdp, tp, fsdp_tp) or a .toml path [fsdp]",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (overrides train.steps)")
    p.add_argument(
        "--run-dir", help="where metrics.jsonl, config.json, tensorboard/ and loss.png go [runs/<config>]"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.learning_rate=1e-3 (repeatable)",
    )
    p.add_argument(
        "--host-devices",
        type=int,
        default=_env_host_devices(),
        help="simulate N CPU devices per process (uses the CPU backend) [$SPMD_HOST_DEVICES]",
    )
    p.add_argument("--seed", type=int, help="seed for init and data order (overrides train.seed)")
    p.add_argument("--log-every", type=int, help="log metrics every N steps (overrides train.log_every)")
    p.add_argument(
        "--eval-every", type=int, help="held-out eval every N steps, 0 = never (overrides train.eval_every)"
    )
    p.add_argument(
        "--print-sharding",
        action="store_true",
        help="print every parameter's sharding and per-device bytes, then exit (allocates nothing)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing run directory (its checkpoints too)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        help="save a checkpoint every N steps (overrides checkpoint.every; "
        "one is always saved at the end and on SIGTERM/SIGINT)",
    )
    from spmd.distributed import add_flags

    add_flags(p)
    p.add_argument(
        "--resume-from",
        metavar="PATH",
        help="start from another run's checkpoint: a run dir (its latest "
        "committed step) or one step, e.g. runs/a/checkpoints/200. Without it, a run dir that holds "
        "checkpoints resumes from its latest committed one",
    )
    return p


def _env_host_devices() -> int | None:
    value = os.environ.get("SPMD_HOST_DEVICES")
    return int(value) if value and value.isdigit() else None


def _set_host_devices(n: int) -> None:
    """Must run before JAX initialises a backend."""
    from spmd.errors import UserError

    if n < 1:
        raise UserError(f"--host-devices must be positive, got {n}")
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise UserError("--host-devices must take effect before JAX starts; it was given too late")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from spmd.errors import UserError, report

    try:
        return run(args)
    except UserError as e:
        report(e)
        return _exit_now(2)


def _exit_now(code: int) -> int:
    """Exit without running interpreter shutdown: Orbax/TensorStore worker threads that are still
    failing on a broken checkpoint would otherwise print tracebacks after our one `error:` line."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    if args.host_devices is not None:
        _set_host_devices(args.host_devices)
    from spmd import distributed

    distributed.initialize(args)
    import jax

    from models.llama import count_params, flops_per_token
    from spmd import sharding as sharding_lib
    from spmd.checkpoint import META_VERSION, SUBDIR, Checkpointer
    from spmd.config import load_config
    from spmd.data import make_batches
    from spmd.errors import UserError
    from spmd.mesh import build_mesh, format_mesh
    from spmd.rules import load_rules
    from spmd.train import build_trainer

    overrides = list(args.set)
    for flag, key in (
        ("steps", "train.steps"),
        ("seed", "train.seed"),
        ("log_every", "train.log_every"),
        ("eval_every", "train.eval_every"),
        ("checkpoint_every", "checkpoint.every"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    cfg = load_config(args.config, overrides)
    from models import attention

    try:
        attention_desc = attention.describe(cfg.model.attention_impl, cfg.train.seq_len)
    except ValueError as e:
        raise UserError(str(e)) from None
    mesh = build_mesh(args.mesh, args.dcn_mesh)
    rules = load_rules(args.rules).with_attention(cfg.attention)
    plan = sharding_lib.plan(
        cfg.model, mesh, rules, cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.microbatches
    )
    trainer = build_trainer(cfg, plan)
    is_main = jax.process_index() == 0

    if args.print_sharding:
        if is_main:
            print(sharding_lib.sharding_table(plan, trainer.abstract_state["opt_state"]))
        return 0

    batches = make_batches(cfg, plan.batch_sharding)
    run_dir = pathlib.Path(args.run_dir or f"runs/{cfg.name}")
    state, start_step, warnings = _initial_state(args, cfg, trainer, batches, run_dir)
    # Every process checks (the run dir is on a shared filesystem), so all fail alike; one writes.
    has_files = run_dir.exists() and any(run_dir.iterdir())
    if has_files and not args.overwrite and not (run_dir / SUBDIR).is_dir():
        raise UserError(
            f"run directory {str(run_dir)!r} already holds files but no checkpoints; "
            f"pass a new --run-dir or --overwrite"
        )
    if is_main:
        if has_files and args.overwrite:
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        _trim_metrics(run_dir / "metrics.jsonl", start_step)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("run directory ready")

    # Everything above validated the input; from here on we write.
    from spmd.metrics import peak_flops

    T, B = cfg.train.seq_len, cfg.train.global_batch_size
    peak, peak_how = peak_flops(cfg.model.dtype)
    fpt = flops_per_token(cfg.model, T)
    resolved = {
        "config": cfg.to_json(),
        "mesh": {"spec": args.mesh, "dcn_spec": args.dcn_mesh, "shape": dict(mesh.shape)},
        "rules": rules.to_json(),
        "devices": {
            "count": jax.device_count(),
            "processes": jax.process_count(),
            "platform": jax.devices()[0].platform,
            "kind": jax.devices()[0].device_kind,
        },
        "model": {"params": count_params(cfg.model), "flops_per_token": fpt},
        "peak_flops": {"value": peak, "source": peak_how},
        "data": batches.description,
    }
    if is_main:
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
        _log(
            f"config {cfg.name}: {count_params(cfg.model):,} params, {cfg.model.n_layers} layers, "
            f"compute {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}"
        )
        _log(f"attention: {attention_desc}")
        _log(
            f"mesh: {format_mesh(dict(mesh.shape))} over {jax.device_count()} {jax.devices()[0].platform} devices "
            f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}); rules: {rules.name}"
        )
        _log(
            f"per device: params {sharding_lib.fmt_bytes(plan.param_bytes_per_device)}, optimizer state "
            f"{sharding_lib.fmt_bytes(sharding_lib.tree_bytes_per_device(trainer.abstract_state['opt_state']))}"
        )
        if plan.replication_warning():
            _log(plan.replication_warning())
        for w in warnings:
            _log(w)
        _log(f"data: {batches.description}; {batches.n_train_windows:,} training windows of {T} tokens")
        _log(
            f"batch: {B} sequences x {T} tokens = {B * T:,} tokens/step in {cfg.train.microbatches} microbatch(es)"
        )
        _log(f"peak for MFU: {peak / 1e9:,.1f} GFLOP/s ({peak_how})")

    if start_step >= cfg.train.steps:
        if is_main:
            _log(f"already at step {start_step} (train.steps = {cfg.train.steps}): nothing to train")
        return 0
    t0 = time.perf_counter()
    step_fn = trainer.train_step.lower(state, batches.train_batch(start_step)).compile()
    if is_main:
        _log(f"compiled train step in {time.perf_counter() - t0:.1f}s")

    def meta(step: int) -> dict:
        return {
            "version": META_VERSION,
            "step": step,
            "consumed_samples": batches.consumed_samples(step),
            "global_batch_size": B,
            "seq_len": T,
            "seed": cfg.train.seed,
            "run": resolved,
        }

    checkpointer = Checkpointer(run_dir, cfg.checkpoint)
    preemption = Preemption()
    preemption.install()
    try:
        history = train_loop(
            cfg,
            trainer,
            step_fn,
            state,
            batches,
            run_dir if is_main else None,
            fpt,
            peak,
            start_step,
            checkpointer,
            meta,
            preemption,
        )
    finally:
        checkpointer.close()
    if preemption.signal is not None:
        if is_main:
            _log(
                f"stopped by signal {preemption.signal}: checkpoint for step {checkpointer.last_saved} committed "
                f"in {checkpointer.directory}"
            )
        return 0
    if is_main and history:
        last = history[-1]
        evals = [r["eval_loss"] for r in history if "eval_loss" in r]
        _log(
            f"done: step {last['step']}, loss {last['loss']:.4f}"
            + (f", eval loss {evals[-1]:.4f}" if evals else "")
            + f"; run dir {run_dir}"
        )
    return 0


class Preemption:
    """First SIGTERM/SIGINT: finish the step, save, wait for the commit, exit 0. Second: abort now.

    Aborting skips Python's shutdown, so an in-flight save stays uncommitted (a temporary directory
    that is never listed) and committed checkpoints are untouched.
    """

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def requested(self) -> bool:
        """Whether to stop after this step. With several processes they must agree (a signal can
        reach them at different steps), so any process's request stops them all at the same step."""
        import jax

        if jax.process_count() == 1:
            return self.signal is not None
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.signal or 0))
        if self.signal is None and flags.any():
            self.signal = int(flags.max())
        return bool(flags.any())

    def _handle(self, signum, frame):
        if self.signal is not None:
            os._exit(128 + signum)
        self.signal = signum
        _log(
            f"signal {signum}: finishing this step, then saving a checkpoint (send it again to abort at once)"
        )


def _initial_state(args, cfg, trainer, batches, run_dir):
    """(state, step, warnings): restored from a checkpoint when there is one to resume, else fresh.

    Reads only, so that any error here leaves the run directory as it was.
    """
    from spmd import checkpoint as ckpt

    own = run_dir / ckpt.SUBDIR
    warnings, source = [], None
    if args.resume_from:
        source = ckpt.locate(args.resume_from)
    elif not args.overwrite and own.is_dir():
        steps = ckpt.committed_steps(own)
        if steps:
            source = (own, steps[-1])
        elif ckpt.uncommitted(own):
            warnings.append(
                f"warning: {own} holds only uncommitted checkpoints ({', '.join(ckpt.uncommitted(own))}) "
                f"from an interrupted save; starting fresh and removing them"
            )
    if source is None:
        return trainer.init_state(), 0, warnings
    directory, step = source
    state, meta = ckpt.restore(directory, step, trainer.abstract_state)
    saved_batch, consumed = int(meta["global_batch_size"]), int(meta["consumed_samples"])
    batches.resume_at(step, consumed)
    warnings.append(f"resumed from {directory}/{step}: step {step}, {consumed:,} samples consumed")
    if saved_batch != cfg.train.global_batch_size:
        warnings.append(
            f"warning: global batch size changed from {saved_batch} to {cfg.train.global_batch_size}: data continues "
            f"at sample {consumed:,} (nothing skipped or repeated), the step count and learning-rate schedule "
            f"continue from step {step}, so each later step sees {cfg.train.global_batch_size} sequences"
        )
    for key, now in (("seq_len", cfg.train.seq_len), ("seed", cfg.train.seed)):
        if int(meta.get(key, now)) != now:
            warnings.append(
                f"warning: train.{key} was {meta[key]} when the checkpoint was written and is {now} now; "
                f"the data order after the restore differs from the original run's"
            )
    return state, step, warnings


def _trim_metrics(path: pathlib.Path, last_step: int) -> None:
    """Drop logged steps after `last_step` (a run killed after its last checkpoint logged them)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def train_loop(
    cfg,
    trainer,
    step_fn,
    state,
    batches,
    run_dir,
    flops_per_tok,
    peak,
    start_step=0,
    checkpointer=None,
    meta=None,
    preemption=None,
):
    """Run steps start_step..cfg.train.steps; log, evaluate, write metrics (process 0) and checkpoints."""
    import jax
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from spmd.metrics import MetricsWriter
    from spmd.train import evaluate

    tcfg = cfg.train
    tokens_per_step = tcfg.global_batch_size * tcfg.seq_len
    writer = MetricsWriter(run_dir) if run_dir is not None else None
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[tok_s]} tok/s  MFU {task.fields[mfu]}  ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=run_dir is None,
    )
    task = progress.add_task("train", total=tcfg.steps, completed=start_step, loss="-", tok_s="-", mfu="-")
    every = cfg.checkpoint.every
    t_last, steps_since = time.perf_counter(), 0
    with progress:
        for step in range(start_step, tcfg.steps):
            state, metrics = step_fn(state, batches.train_batch(step))
            steps_since += 1
            done = step + 1
            stopping = preemption is not None and preemption.requested()
            is_eval = bool(tcfg.eval_every) and (done % tcfg.eval_every == 0 or done == tcfg.steps)
            if stopping or is_eval or done % tcfg.log_every == 0 or done == tcfg.steps:
                m = jax.device_get(metrics)
                now = time.perf_counter()
                tok_s = steps_since * tokens_per_step / (now - t_last)
                record = {
                    "step": done,
                    "loss": float(m["loss"]),
                    "tokens_per_sec": tok_s,
                    "mfu": tok_s * flops_per_tok / peak,
                    "learning_rate": float(m["learning_rate"]),
                    "grad_norm": float(m["grad_norm"]),
                    "step_time": (now - t_last) / steps_since,
                }
                if tcfg.z_loss:
                    record["z_loss"] = float(m["z_loss"])
                record.update({key: float(v) for key, v in m.items() if key.startswith("moe_")})
                if is_eval:
                    record["eval_loss"] = evaluate(trainer, state["params"], batches)
                progress.update(
                    task,
                    completed=done,
                    loss=f"{record['loss']:.3f}",
                    tok_s=f"{tok_s:,.0f}",
                    mfu=f"{record['mfu']:.1%}",
                )
                if writer:
                    writer.write(record)
                    progress.console.print(
                        f"step {done:>6}  loss {record['loss']:.4f}  lr {record['learning_rate']:.2e}  "
                        f"grad_norm {record['grad_norm']:.3f}  {tok_s:,.0f} tok/s  MFU {record['mfu']:.1%}"
                        + (f"  eval_loss {record['eval_loss']:.4f}" if is_eval else ""),
                        highlight=False,
                        soft_wrap=True,
                    )
                # Eval and checkpoint time is not training time.
                t_last, steps_since = time.perf_counter(), 0
            if checkpointer is not None and ((every and done % every == 0) or done == tcfg.steps or stopping):
                t_save = time.perf_counter()
                checkpointer.save(done, state, meta(done))
                t_last += time.perf_counter() - t_save  # the blocking part of a save is not training time
            if stopping:
                checkpointer.wait()
                break
    if writer:
        writer.close()
    return writer.history if writer else []


if __name__ == "__main__":
    sys.exit(main())
