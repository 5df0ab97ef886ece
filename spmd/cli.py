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
    p.add_argument("--config", default="small", help="config preset in configs/ (tiny, small, llama-1b, ...) or a .toml path [small]")
    p.add_argument("--mesh", default="fsdp=-1", help="mesh shape, e.g. data=2,fsdp=2,tensor=2; must multiply to the device count [fsdp=-1]")
    p.add_argument("--dcn-mesh", default="", help="mesh across processes (multi-host), e.g. data=2; then --mesh is per process")
    p.add_argument("--rules", default="fsdp", help="sharding rules: a preset in sharding_rules/ (dp, fsdp, tp, fsdp_tp) or a .toml path [fsdp]")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides train.steps)")
    p.add_argument("--run-dir", help="where metrics.jsonl, config.json, tensorboard/ and loss.png go [runs/<config>]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. --set train.learning_rate=1e-3 (repeatable)")
    p.add_argument("--host-devices", type=int, help="simulate N CPU devices (uses the CPU backend)")
    p.add_argument("--seed", type=int, help="seed for init and data order (overrides train.seed)")
    p.add_argument("--log-every", type=int, help="log metrics every N steps (overrides train.log_every)")
    p.add_argument("--eval-every", type=int, help="held-out eval every N steps, 0 = never (overrides train.eval_every)")
    p.add_argument("--print-sharding", action="store_true", help="print every parameter's sharding and per-device bytes, then exit (allocates nothing)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    return p


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
    from spmd.errors import UserError

    try:
        return run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    if args.host_devices is not None:
        _set_host_devices(args.host_devices)
    import jax

    from models.llama import count_params, flops_per_token
    from spmd import sharding as sharding_lib
    from spmd.config import load_config
    from spmd.data import make_batches
    from spmd.errors import UserError
    from spmd.mesh import build_mesh, format_mesh
    from spmd.rules import load_rules
    from spmd.train import build_trainer

    overrides = list(args.set)
    for flag, key in (("steps", "train.steps"), ("seed", "train.seed"), ("log_every", "train.log_every"),
                      ("eval_every", "train.eval_every")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    cfg = load_config(args.config, overrides)
    mesh = build_mesh(args.mesh, args.dcn_mesh)
    rules = load_rules(args.rules)
    plan = sharding_lib.plan(cfg.model, mesh, rules, cfg.train.global_batch_size, cfg.train.seq_len,
                             cfg.train.microbatches)
    trainer = build_trainer(cfg, plan)
    is_main = jax.process_index() == 0

    if args.print_sharding:
        if is_main:
            print(sharding_lib.sharding_table(plan, trainer.abstract_state["opt_state"]))
        return 0

    batches = make_batches(cfg, plan.batch_sharding)
    run_dir = pathlib.Path(args.run_dir or f"runs/{cfg.name}")
    if is_main:
        if run_dir.exists() and any(run_dir.iterdir()):
            if not args.overwrite:
                raise UserError(f"run directory {str(run_dir)!r} already holds files; pass a new --run-dir or --overwrite")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)

    # Everything above validated the input; from here on we write.
    from spmd.metrics import peak_flops

    T, B = cfg.train.seq_len, cfg.train.global_batch_size
    peak, peak_how = peak_flops(cfg.model.dtype)
    fpt = flops_per_token(cfg.model, T)
    resolved = {
        "config": cfg.to_json(),
        "mesh": {"spec": args.mesh, "dcn_spec": args.dcn_mesh, "shape": dict(mesh.shape)},
        "rules": rules.to_json(),
        "devices": {"count": jax.device_count(), "processes": jax.process_count(),
                    "platform": jax.devices()[0].platform, "kind": jax.devices()[0].device_kind},
        "model": {"params": count_params(cfg.model), "flops_per_token": fpt},
        "peak_flops": {"value": peak, "source": peak_how},
        "data": batches.description,
    }
    if is_main:
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
        _log(f"config {cfg.name}: {count_params(cfg.model):,} params, {cfg.model.n_layers} layers, "
             f"compute {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}")
        _log(f"attention: {cfg.model.attention_impl}")
        _log(f"mesh: {format_mesh(dict(mesh.shape))} over {jax.device_count()} {jax.devices()[0].platform} devices "
             f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}); rules: {rules.name}")
        _log(f"per device: params {sharding_lib.fmt_bytes(plan.param_bytes_per_device)}, optimizer state "
             f"{sharding_lib.fmt_bytes(sharding_lib.tree_bytes_per_device(trainer.abstract_state['opt_state']))}")
        if plan.replication_warning():
            _log(plan.replication_warning())
        _log(f"data: {batches.description}; {batches.n_train_windows:,} training windows of {T} tokens")
        _log(f"batch: {B} sequences x {T} tokens = {B * T:,} tokens/step in {cfg.train.microbatches} microbatch(es)")
        _log(f"peak for MFU: {peak / 1e9:,.1f} GFLOP/s ({peak_how})")

    state = trainer.init_state()
    t0 = time.perf_counter()
    step_fn = trainer.train_step.lower(state, batches.train_batch(0)).compile()
    if is_main:
        _log(f"compiled train step in {time.perf_counter() - t0:.1f}s")
    history = train_loop(cfg, trainer, step_fn, state, batches, run_dir if is_main else None, fpt, peak)
    if is_main and history:
        last = history[-1]
        evals = [r["eval_loss"] for r in history if "eval_loss" in r]
        _log(f"done: step {last['step']}, loss {last['loss']:.4f}"
             + (f", eval loss {evals[-1]:.4f}" if evals else "") + f"; run dir {run_dir}")
    return 0


def train_loop(cfg, trainer, step_fn, state, batches, run_dir, flops_per_tok, peak):
    """Run cfg.train.steps steps; log, evaluate and write metrics (process 0 writes)."""
    import jax
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from spmd.metrics import MetricsWriter
    from spmd.train import evaluate

    tcfg = cfg.train
    tokens_per_step = tcfg.global_batch_size * tcfg.seq_len
    writer = MetricsWriter(run_dir) if run_dir is not None else None
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[tok_s]} tok/s  MFU {task.fields[mfu]}  ETA"),
        TimeRemainingColumn(), console=Console(stderr=True), disable=run_dir is None,
    )
    task = progress.add_task("train", total=tcfg.steps, loss="-", tok_s="-", mfu="-")
    t_last, steps_since = time.perf_counter(), 0
    with progress:
        for step in range(tcfg.steps):
            state, metrics = step_fn(state, batches.train_batch(step))
            steps_since += 1
            done = step + 1
            is_eval = tcfg.eval_every and (done % tcfg.eval_every == 0 or done == tcfg.steps)
            if done % tcfg.log_every and done != tcfg.steps and not is_eval:
                continue
            m = jax.device_get(metrics)
            now = time.perf_counter()
            tok_s = steps_since * tokens_per_step / (now - t_last)
            record = {
                "step": done, "loss": float(m["loss"]), "tokens_per_sec": tok_s,
                "mfu": tok_s * flops_per_tok / peak, "learning_rate": float(m["learning_rate"]),
                "grad_norm": float(m["grad_norm"]), "step_time": (now - t_last) / steps_since,
            }
            if tcfg.z_loss:
                record["z_loss"] = float(m["z_loss"])
            if is_eval:
                record["eval_loss"] = evaluate(trainer, state["params"], batches)
            progress.update(task, completed=done, loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:,.0f}",
                            mfu=f"{record['mfu']:.1%}")
            if writer:
                writer.write(record)
                progress.console.print(
                    f"step {done:>6}  loss {record['loss']:.4f}  lr {record['learning_rate']:.2e}  "
                    f"grad_norm {record['grad_norm']:.3f}  {tok_s:,.0f} tok/s  MFU {record['mfu']:.1%}"
                    + (f"  eval_loss {record['eval_loss']:.4f}" if is_eval else ""),
                    highlight=False, soft_wrap=True,
                )
            # Eval time is not training time.
            t_last, steps_since = time.perf_counter(), 0
    if writer:
        writer.close()
    return writer.history if writer else []


if __name__ == "__main__":
    sys.exit(main())
