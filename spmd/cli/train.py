"""`spmd-train`: train a model from a config preset, a mesh shape and a sharding-rules file.

parse -> assemble (spmd.setup) -> resume or initialise (spmd.checkpoint) -> loop with hooks (spmd.loop).
"""

import argparse
import json
import pathlib
import shutil
import sys
import time

from spmd.cli.common import Parser, add_host_devices, log, run_main

STARTED = time.perf_counter()  # the goodput ledger's `init` starts here (the process's start, near enough)

EPILOG = """
examples:
  spmd-train --config small --mesh fsdp=8 --rules fsdp --host-devices 8 --run-dir runs/quickstart
  spmd-train --config tiny --mesh data=2,fsdp=2,tensor=2 --rules fsdp_tp --host-devices 8 --steps 20
  spmd-train --config llama-8b --mesh fsdp=-1,tensor=4 --rules fsdp_tp --host-devices 64 --print-sharding
  spmd-train --config tiny --set optimizer.learning_rate=1e-3 --set model.remat=full

mesh axes: data, fsdp, context, expert, tensor (unnamed axes are 1; one size may be -1 = fill).
Config keys are listed in README.md ("Config keys"); --set takes section.key=value.
"""
# Shorthand flags and the config keys they set.
SHORTHANDS = {
    "steps": "train.steps",
    "seed": "train.seed",
    "log_every": "train.log_every",
    "eval_every": "train.eval_every",
    "checkpoint_every": "checkpoint.every",
}


def build_parser() -> argparse.ArgumentParser:
    from spmd.distributed import add_flags

    p = Parser(
        prog="spmd-train",
        description="Train a sharded transformer. The mesh comes from --mesh; how each parameter and "
        "activation is split over it comes from the --rules file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add(
        "--config",
        help="config preset in configs/ (tiny, small, llama-1b, ...) or a .toml path "
        "[small; with --init-from, the checkpoint's own config]",
    )
    add(
        "--mesh",
        default="fsdp=-1",
        help="mesh shape, e.g. data=2,fsdp=2,tensor=2; must multiply to the device count [fsdp=-1]",
    )
    add(
        "--dcn-mesh",
        default="",
        help="mesh across processes (multi-host), e.g. data=2; then --mesh is per process",
    )
    add(
        "--rules",
        default="fsdp",
        help="sharding rules: a preset in sharding_rules/ (dp, fsdp, tp, fsdp_tp) or a .toml path [fsdp]",
    )
    add("--steps", type=int, help="optimizer steps (overrides train.steps)")
    add("--run-dir", help="where metrics.jsonl, config.json, tensorboard/ and loss.png go [runs/<config>]")
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optimizer.learning_rate=1e-3 (repeatable)",
    )
    add_host_devices(p, "simulate N CPU devices per process (uses the CPU backend)", from_env=True)
    add("--seed", type=int, help="seed for init and data order (overrides train.seed)")
    add("--log-every", type=int, help="log metrics every N steps (overrides train.log_every)")
    add("--eval-every", type=int, help="held-out eval every N steps, 0 = never (overrides train.eval_every)")
    add(
        "--print-sharding",
        action="store_true",
        help="print every parameter's sharding and per-device bytes, then exit (allocates nothing)",
    )
    add(
        "--print-rules",
        action="store_true",
        help="print the resolved rules (after extends and [attention] overrides) and the file that set each entry, then exit",
    )
    add("--overwrite", action="store_true", help="replace an existing run directory (its checkpoints too)")
    add(
        "--checkpoint-every",
        type=int,
        help="save a checkpoint every N steps (overrides checkpoint.every; "
        "one is always saved at the end and on SIGTERM/SIGINT)",
    )
    add_flags(p)
    add(
        "--resume-from",
        metavar="PATH",
        help="start from another run's checkpoint: a run dir (its latest "
        "committed step) or one step, e.g. runs/a/checkpoints/200. Without it, a run dir that holds "
        "checkpoints resumes from its latest committed one",
    )
    add(
        "--profile-steps",
        metavar="A:B",
        help="write a jax.profiler trace of steps A..B (1-based, inclusive) into <run-dir>/profile/ "
        "(open it with TensorBoard's profile plugin or xprof)",
    )
    add(
        "--init-from",
        metavar="PATH",
        help="start from the parameters of a checkpoint (a run dir or one step, e.g. one spmd-ckpt import-hf "
        "wrote): fresh optimizer state, step 0, on any mesh and rules. Once the new run has checkpoints, "
        "rerunning the command resumes from them",
    )
    return p  # fmt: skip


def main(argv=None) -> int:
    # only a command run from its command line may relaunch itself (cpu.host_heap=tbbmalloc)
    return run_main(build_parser(), lambda args: run(args, may_relaunch=argv is None), argv)


def run(args, may_relaunch: bool = False) -> int:
    from spmd import distributed
    from spmd.setup import before_jax_starts

    overrides = list(args.set) + [
        f"{k}={getattr(args, f)}" for f, k in SHORTHANDS.items() if getattr(args, f) is not None
    ]
    before_jax_starts(args.config or "small", overrides, may_relaunch=may_relaunch)
    distributed.initialize_from_flags(args)
    import jax

    from spmd import runlock
    from spmd import sharding as sharding_lib
    from spmd.checkpoint import resume_or_init
    from spmd.data import data_tokenizer
    from spmd.rules import rules_table
    from spmd.setup import assemble

    init = initial_parameters(args)
    profile = profile_steps(args.profile_steps)
    config = args.config or (init["config"] if init else "small")
    setup = assemble(config, args.mesh, args.rules, overrides=overrides, dcn_mesh=args.dcn_mesh)
    is_main = jax.process_index() == 0
    if args.print_rules or args.print_sharding:
        if is_main and args.print_rules:
            print(rules_table(setup.rules))
        if is_main and args.print_sharding:
            print(sharding_lib.sharding_table(setup.plan, setup.trainer.abstract_state["opt_state"]))
        return 0
    batches = setup.batches()
    tokenizer = data_tokenizer(setup.cfg.data)
    run_dir = pathlib.Path(args.run_dir or f"runs/{setup.cfg.name}")
    start = resume_or_init(setup.trainer, batches, run_dir, args.resume_from, args.overwrite, args.init_from)
    # Everything above validated the input; from here on we write, holding the run dir's lock.
    lock = runlock.acquire(run_dir)
    try:
        lost = prepare_run_dir(run_dir, start.step, args.overwrite, is_main)
        resolved = describe_run(
            setup, batches, run_dir, start.notes, is_main, init["record"] if init else None, tokenizer
        )
        if is_main:
            keep_tokenizer(tokenizer, run_dir)
        if init and is_main:
            copy_tokenizer(init["run_dir"], run_dir)
        return train(setup, batches, run_dir, start, resolved, is_main, profile, lost)
    finally:
        lock.release()


def profile_steps(text: str | None) -> tuple[int, int] | None:
    """--profile-steps A:B -> (A, B), 1-based and inclusive."""
    if text is None:
        return None
    from spmd.errors import UserError

    first, colon, last = text.partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        a, b = 0, 0
    if not (colon or not last) or not 1 <= a <= b:
        raise UserError(f"--profile-steps must look like A:B with 1 <= A <= B (steps, 1-based), got {text!r}")
    return a, b


def initial_parameters(args) -> dict | None:
    """For --init-from: the checkpoint's config (the default --config), where it lies, and what the
    new run records of it (including the Hugging Face config it was imported from, for export)."""
    if not args.init_from:
        return None
    from spmd import checkpoint as ckpt
    from spmd.config import config_from_json
    from spmd.errors import UserError

    if args.resume_from:
        raise UserError("--init-from and --resume-from exclude each other: one starts fresh, one resumes")
    directory, step = ckpt.locate(args.init_from)
    run = ckpt.check_meta(directory, step, ckpt.read_meta(directory, step), ("run",))["run"]
    record = {"path": str(directory / str(step)), "step": step}
    origin = run.get("hf") or run.get("init_from", {}).get("hf")
    if origin:
        record["hf"] = origin
    run_dir = ckpt.run_dir_of(directory)
    return {"config": config_from_json(run["config"]), "record": record, "run_dir": run_dir}


def keep_tokenizer(tokenizer, run_dir: pathlib.Path) -> None:
    """The data's tokenizer file goes into the run dir (tokenizer.json or tokenizer.model), where
    spmd-sample, spmd-eval and export-hf find it."""
    from spmd.tokenizer import run_file_name

    name = run_file_name(tokenizer)
    if name and tokenizer.file.resolve() != (run_dir / name).resolve():
        tmp = run_dir / f".{name}.tmp"
        shutil.copy2(tokenizer.file, tmp)
        tmp.replace(run_dir / name)


def copy_tokenizer(src: pathlib.Path, dst: pathlib.Path) -> None:
    """The tokenizer files of the run we start from travel with the new run (export takes them)."""
    from spmd.hf import TOKENIZER_FILES

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
}


def prepare_run_dir(run_dir: pathlib.Path, start_step: int, overwrite: bool, is_main: bool) -> float:
    """Make (or, with --overwrite, replace) the run directory; a resumed run's metrics.jsonl is cut
    back to the restored step, and a run that never checkpointed is started afresh (its logs
    cleared). Every process checks (the run dir is on a shared filesystem), so all fail alike;
    process 0 writes. Returns the seconds an earlier attempt trained past `start_step` (lost to
    the restart; on process 0)."""
    import jax

    from spmd import runlock
    from spmd.checkpoint import SUBDIR, committed_steps
    from spmd.errors import UserError
    from spmd.goodput import lost_seconds
    from spmd.hf import TOKENIZER_FILES
    from spmd.loop import trim_metrics

    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {str(run_dir)!r} is a file; give a directory")
    entries = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    never_checkpointed = not committed_steps(run_dir / SUBDIR)
    if entries and never_checkpointed and not overwrite and not entries <= RUN_FILES | set(TOKENIZER_FILES):
        raise UserError(
            f"run directory {str(run_dir)!r} already holds files but no checkpoints; pass a new --run-dir or --overwrite"
        )
    if is_main:
        try:
            if entries and overwrite:  # everything but the lock we hold
                for path in run_dir.iterdir():
                    if path.name != runlock.LOCK:
                        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            elif entries and never_checkpointed and start_step == 0:
                for name in ("tensorboard", "loss.png"):  # the abandoned start's logs
                    path = run_dir / name
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"--run-dir {str(run_dir)!r} cannot be created or cleared: {e.strerror}"
            ) from None
        lost = lost_seconds(trim_metrics(run_dir / "metrics.jsonl", start_step), start_step)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("run directory ready")
    return lost if is_main else 0.0


def describe_run(
    setup, batches, run_dir: pathlib.Path, notes: list[str], is_main: bool, init_from: dict | None = None,
    tokenizer=None,
) -> dict:  # fmt: skip
    """Write config.json (the fully resolved run) and log what will run; returns the resolved run.
    `init_from`: where --init-from took the parameters (kept with every checkpoint's metadata)."""
    import jax

    from spmd import hostmem
    from spmd.mesh import format_mesh
    from spmd.metrics import peak_flops
    from spmd.sharding import fmt_bytes, tree_bytes_per_device

    cfg, plan = setup.cfg, setup.plan
    T, B = cfg.train.seq_len, cfg.train.global_batch_size
    figures = plan.family.figures(cfg.model, T)
    peak, peak_how = peak_flops(cfg.model.dtype)
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
        **(
            {
                "tokenizer": {
                    "name": tokenizer.name,
                    "sha256": tokenizer.sha256,
                    "vocab_size": tokenizer.vocab_size,
                    "eos_id": tokenizer.eos_id,
                }
            }
            if tokenizer is not None
            else {}
        ),  # fmt: skip
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
            [
                f"host heap: {hostmem.active()}, freed memory kept for the next step (cpu.host_heap={cfg.cpu.host_heap})"
            ]
            if hostmem.retained()
            else []
        ),
        *notes,
        f"data: {batches.description}; {batches.n_train_windows:,} training windows of {T} tokens",
        f"batch: {B} sequences x {T} tokens = {B * T:,} tokens/step in {cfg.train.microbatches} microbatch(es)",
        f"peak for MFU: {peak / 1e9:,.1f} GFLOP/s ({peak_how})",
    ]
    for line in lines:
        log(line)
    return resolved


def train(
    setup,
    batches,
    run_dir: pathlib.Path,
    start,
    resolved: dict,
    is_main: bool,
    profile=None,
    lost: float = 0.0,
) -> int:
    """Compile the step, then run the loop with its hooks from `start` to train.steps, watched
    (spmd.watchdog) and accounted (spmd.goodput)."""
    import jax

    from spmd import checkpoint as ckpt
    from spmd import goodput, loop
    from spmd.metrics import MetricsWriteError, MetricsWriter
    from spmd.trainer import evaluate_all
    from spmd.watchdog import Watchdog

    cfg, trainer = setup.cfg, setup.trainer
    tcfg = cfg.train
    if start.step >= tcfg.steps:
        if is_main:
            log(f"already at step {start.step} (train.steps = {tcfg.steps}): nothing to train")
        return 0
    ledger = goodput.Ledger(STARTED, start.goodput)
    ledger.add("lost", lost)
    t0 = time.perf_counter()
    ledger.add("init", t0 - STARTED)
    step_fn = trainer.train_step.lower(start.state, batches.train_batch(start.step)).compile()
    compile_seconds = time.perf_counter() - t0
    ledger.add("compile", compile_seconds)
    if is_main:
        log(f"compiled train step in {compile_seconds:.1f}s")

    checkpointer = ckpt.Checkpointer(run_dir, cfg.checkpoint)
    hooks = [loop.EvalHook(tcfg.eval_every, lambda params: evaluate_all(trainer, params, batches))]
    metrics = None
    if is_main:
        metrics = loop.MetricsHook(
            tcfg.log_every, tcfg.eval_every, tcfg.global_batch_size * tcfg.seq_len,
            resolved["model"]["flops_per_token"], resolved["peak_flops"]["value"], z_loss=bool(tcfg.z_loss),
            writer=MetricsWriter(run_dir), start_step=start.step, ledger=ledger,
        )  # fmt: skip
        hooks += [metrics, loop.ProgressHook(tcfg.log_every, tcfg.eval_every, tcfg.steps, start.step)]
    hooks.append(
        loop.CheckpointHook(
            checkpointer,
            cfg.checkpoint.every,
            lambda step: ckpt.step_meta(step, batches, tcfg, resolved, ledger.totals()),
            setup.trainer.to_canonical,
        )
    )
    if profile is not None and is_main:
        hooks.append(loop.ProfileHook(run_dir / "profile", *profile, start.step))
    preemption = loop.Preemption().install()
    watchdog = Watchdog(tcfg.step_timeout, run_dir / "hangs", jax.process_index(), compile_seconds)
    try:
        loop.TrainLoop(
            step_fn, batches, hooks, stop=preemption.requested, max_skipped=tcfg.max_skipped_steps, ledger=ledger,
            watchdog=watchdog,
        ).run(start.state, start.step, tcfg.steps)  # fmt: skip
    except MetricsWriteError as e:
        raise MetricsWriteError(f"{e}; {ckpt.kept_checkpoints(checkpointer.directory)}") from None

    if preemption.signal is not None:
        if is_main:
            log(f"stopped by signal {preemption.signal}: checkpoint for step {checkpointer.last_saved} committed "
                f"in {checkpointer.directory}; {goodput.summary(ledger.totals())}")  # fmt: skip
        return 0
    if metrics is not None and metrics.history:
        last = metrics.history[-1]
        evals = [r["eval_loss"] for r in metrics.history if "eval_loss" in r]
        log(f"done: step {last['step']}, loss {last['loss']:.4f}" + (f", eval loss {evals[-1]:.4f}" if evals else "")
            + f"; {goodput.summary(ledger.totals())}; run dir {run_dir}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
