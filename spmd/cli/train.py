"""`spmd-train`: train a model from a config preset, a mesh shape and a sharding-rules file.

parse -> assemble (spmd.assembly.setup) -> the run in its directory (spmd.run.train: resume or initialise,
the loop with its hooks).
"""

import argparse
import pathlib
import sys
import time

from spmd.cli.common import Parser, add_host_devices, add_trust_flag, run_main

STARTED = time.perf_counter()  # the goodput ledger's `init` starts here (the process's start, near enough)

EPILOG = """
examples:
  spmd-train --config small --mesh fsdp=8 --rules fsdp --host-devices 8 --run-dir runs/quickstart
  spmd-train --config tiny --mesh data=2,fsdp=2,tensor=2 --rules fsdp_tp --host-devices 8 --steps 20
  spmd-train --config llama-8b --mesh fsdp=-1,tensor=4 --rules fsdp_tp --host-devices 64 --print-sharding
  spmd-train --config tiny --set optimizer.learning_rate=1e-3 --set model.remat=full

--list-keys prints every config key (of --config's model family) with its value; --set takes
section.key=value. Docs: docs/ (parallelism and presets, data, checkpoints, ...).
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
    from spmd.cli.common import add_run_flags
    from spmd.platform.distributed import add_flags

    p = Parser(
        prog="spmd-train",
        description="Train a sharded transformer. The mesh comes from --mesh; how each parameter and "
        "activation is split over it comes from the --rules file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    add_run_flags(p, None, "small; with --init-from, the checkpoint's own config")
    add(
        "--dcn-mesh",
        default="",
        help="mesh across processes (multi-host), e.g. data=2; then --mesh is per process",
    )
    add("--steps", type=int, help="optimizer steps (overrides train.steps)")
    add("--run-dir", help="where metrics.jsonl, config.json, tensorboard/ and loss.png go [runs/<config>]")
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
        "--list-keys",
        action="store_true",
        help="print every config key with its value (after --set), then exit",
    )
    add(
        "--print-rules",
        action="store_true",
        help="print the resolved rules (after extends) and the file that set each entry, then exit",
    )
    add("--overwrite", action="store_true", help="replace an existing run directory (its checkpoints too)")
    add(
        "--checkpoint-every",
        type=int,
        help="save a checkpoint every N steps (overrides checkpoint.every; "
        "one is always saved at the end and on SIGTERM/SIGINT)",
    )
    add_flags(p)
    add_trust_flag(p)
    add(
        "--allow-tokenizer-change",
        action="store_true",
        help="start from a checkpoint trained with another tokenizer than the data's (a deliberate swap, "
        "e.g. with a remapped embedding); otherwise an error",
    )
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
    from spmd.assembly.setup import before_jax_starts
    from spmd.platform import distributed

    overrides = list(args.set) + [
        f"{k}={getattr(args, f)}" for f, k in SHORTHANDS.items() if getattr(args, f) is not None
    ]
    if args.list_keys:
        from spmd.assembly.config import keys_table, load_config

        print(keys_table(load_config(args.config or "small", overrides)))
        return 0
    from spmd.parallel.pipeline import SCHEDULED

    cfg = before_jax_starts(args.config or "small", overrides, may_relaunch=may_relaunch)
    # A scheduled pipeline's stages run different passes, and so different collectives, at once.
    diverging = cfg is not None and (
        cfg.pipeline.schedule in SCHEDULED or cfg.pipeline.backward == "scheduled"
    )
    distributed.initialize_from_flags(args, diverging_collectives=diverging)
    import jax

    from spmd import run as run_lib
    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError
    from spmd.core.rules import rules_table
    from spmd.parallel import sharding as sharding_lib

    if args.init_from and args.resume_from:
        raise UserError("--init-from and --resume-from exclude each other: one starts fresh, one resumes")
    init = run_lib.init_source(args.init_from) if args.init_from else None
    profile = profile_steps(args.profile_steps)
    config = args.config or (init["config"] if init else "small")
    setup = assemble(config, args.mesh, args.rules, overrides=overrides, dcn_mesh=args.dcn_mesh)
    if args.print_rules or args.print_sharding:
        if jax.process_index() == 0 and args.print_rules:
            print(rules_table(setup.rules))
        if jax.process_index() == 0 and args.print_sharding:
            print(sharding_lib.sharding_table(setup.plan, setup.trainer.abstract_state["opt_state"]))
        return 0
    run_dir = pathlib.Path(args.run_dir or f"runs/{setup.cfg.name}")
    run_lib.train(
        setup, run_dir, resume_from=args.resume_from, init_from=init, overwrite=args.overwrite, profile=profile,
        allow_tokenizer_change=args.allow_tokenizer_change,
        started=STARTED,
    )  # fmt: skip
    return 0


def profile_steps(text: str | None) -> tuple[int, int] | None:
    """--profile-steps A:B -> (A, B), 1-based and inclusive."""
    if text is None:
        return None
    from spmd.core.errors import UserError

    first, colon, last = text.partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        a, b = 0, 0
    if not (colon or not last) or not 1 <= a <= b:
        raise UserError(f"--profile-steps must look like A:B with 1 <= A <= B (steps, 1-based), got {text!r}")
    return a, b


if __name__ == "__main__":
    sys.exit(main())
