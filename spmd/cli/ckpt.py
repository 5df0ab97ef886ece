"""`spmd-ckpt`: inspect, verify and reshard checkpoints; import and export Hugging Face models."""

import argparse
import math
import pathlib
import sys

from spmd.cli.common import Parser, add_host_devices, add_trust_flag, run_main
from spmd.core.errors import log


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="spmd-ckpt",
        description="Inspect, verify and reshard spmd-train checkpoints; import and export Hugging Face models.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    i = sub.add_parser(
        "inspect",
        help="steps (committed or not), arrays with shapes and dtypes, saved mesh and rules, bytes on disk",
    )
    i.add_argument("path", help="a run dir, its checkpoints dir, or one step")
    v = sub.add_parser(
        "verify", help="read every array of every committed step (or the one given) and check it"
    )
    v.add_argument("path")
    r = sub.add_parser("reshard", help="rewrite a checkpoint for another mesh and rules (offline re-layout)")
    r.add_argument("src", help="a run dir (latest committed step) or one step")
    r.add_argument("dst", help="a new run dir to write <dst>/checkpoints/<step> into")
    r.add_argument("--mesh", required=True)
    r.add_argument("--rules", required=True)
    r.add_argument("--dcn-mesh", default="")
    h = sub.add_parser(
        "import-hf",
        help="a Hugging Face model directory (Llama, Mistral, Qwen2, Mixtral; config.json + safetensors) "
        "-> a run dir with config.toml and a step-0 checkpoint that --init-from, spmd-eval and spmd-sample take",
    )
    h.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="the directory save_pretrained wrote, or a Hugging Face Hub id (org/name: from its cache, downloaded if missing)",
    )
    h.add_argument("--run-dir", required=True, help="the run directory to create")
    h.add_argument(
        "--mesh",
        default="fsdp=-1",
        help="mesh the import reads onto (any: the checkpoint restores on every mesh) [fsdp=-1]",
    )
    h.add_argument("--dcn-mesh", default="")
    h.add_argument("--rules", default="fsdp", help="sharding rules [fsdp]")
    h.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a key of the written config, e.g. --set train.seq_len=2048 --set model.dtype=float32",
    )  # fmt: skip
    h.add_argument("--overwrite", action="store_true", help="replace a run dir that already holds files")
    e = sub.add_parser(
        "export-hf",
        help="a checkpoint (any mesh) -> a Hugging Face directory that AutoModelForCausalLM.from_pretrained loads",
    )
    e.add_argument("run_dir", metavar="RUN_DIR", help="a run dir (latest committed step) or one step")
    e.add_argument("--out", required=True, help="the directory to create")
    e.add_argument("--step", type=int, help="a committed step [latest]")
    e.add_argument(
        "--dtype", choices=("bfloat16", "float32", "float16"), help="tensor dtype [the parameters']"
    )
    e.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB [5GB]")
    e.add_argument("--mesh", default="fsdp=-1", help="mesh to load the checkpoint onto [fsdp=-1]")
    e.add_argument("--rules", default="fsdp")
    how = e.add_mutually_exclusive_group()
    how.add_argument(
        "--merge", action="store_true",
        help="a LoRA run: its adapters folded into the base weights, one model for transformers (the default)",
    )  # fmt: skip
    how.add_argument(
        "--adapter", action="store_true",
        help="a LoRA run: its adapters alone, as a peft adapter directory for the base model",
    )  # fmt: skip
    from spmd.platform.distributed import add_flags

    for q in (i, v, r, e):
        add_trust_flag(q)
    for q in (v, r):
        add_host_devices(q)
    for q in (h, e):  # these two run under spmd-launch too: each process reads and writes its shards
        add_host_devices(q, "simulate N CPU devices per process", from_env=True)
        add_flags(q)
    return p


def main(argv=None) -> int:
    commands = {
        "inspect": inspect, "verify": verify, "reshard": reshard, "import-hf": import_hf, "export-hf": export_hf,
    }  # fmt: skip
    return run_main(build_parser(), lambda args: commands[args.command](args), argv)


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _steps_to_check(path: str):
    from spmd.io import checkpoint as ckpt

    p = pathlib.Path(path).expanduser()
    directory, step = ckpt.locate(path)
    if p.name.isdigit() and p.parent == directory:
        return directory, [step]
    return directory, ckpt.committed_steps(directory)


def inspect(args) -> int:
    import numpy as np

    from spmd.core.mesh import format_mesh
    from spmd.io import checkpoint as ckpt
    from spmd.parallel.sharding import fmt_bytes

    directory, step = ckpt.locate(args.path)
    print(f"checkpoints in {directory}:")
    for s in ckpt.committed_steps(directory):
        print(f"  step {s:>8}  committed    {fmt_bytes(_dir_bytes(directory / str(s))):>12}")
    for name in ckpt.uncommitted(directory):
        print(f"  {name}  uncommitted (an interrupted save; never restored)")
    meta = ckpt.check_meta(
        directory, step, ckpt.read_meta(directory, step), ("consumed_samples", "global_batch_size")
    )
    run = meta.get("run", {})
    mesh = format_mesh(run.get("mesh", {}).get("shape", {}))
    print(f"\nstep {step}:")
    print(
        f"  written by: config {run.get('config', {}).get('name')}, mesh {mesh}, "
        f"rules {run.get('rules', {}).get('name')}, {run.get('devices', {}).get('count')} devices in "
        f"{run.get('devices', {}).get('processes')} process(es)"
    )
    if ckpt.unverified(meta):
        print(f"  integrity: UNVERIFIED, its metadata has no {' and no '.join(ckpt.unverified(meta))}")
    if run.get("hf"):
        print(f"  imported from {run['hf']['source']} ({run['hf']['architecture']}): parameters only")
    lora = run.get("config", {}).get("lora") or {}
    if lora.get("rank"):
        origin = run.get("init_from") or {}
        base = (
            origin.get("path")
            or f"drawn from seed {origin.get('seed', run.get('config', {}).get('train', {}).get('seed'))}"
        )
        print(
            f"  LoRA adapters (rank {lora['rank']}, alpha {lora.get('alpha')}, "
            f"{', '.join(lora.get('targets') or [])}) on the frozen base {base}; the base is not in this checkpoint"
        )
    elif (run.get("init_from") or {}).get("path"):
        print(f"  parameters initialised from {run['init_from']['path']}")
    print(
        f"  data position: {meta['consumed_samples']:,} samples consumed (global batch {meta['global_batch_size']}, "
        f"seq_len {meta.get('seq_len')}, seed {meta.get('seed')})"
    )
    arrays = ckpt.saved_arrays(directory, step)
    total = 0
    print("  arrays:")
    width = max(len(k) for k in arrays)
    for key, (shape, dtype) in arrays.items():
        n = math.prod(shape) * np.dtype(dtype).itemsize
        total += n
        print(f"    {key.ljust(width)}  {str(shape):>22}  {dtype:>8}  {fmt_bytes(n):>12}")
    print(
        f"  {len(arrays)} arrays, {fmt_bytes(total)} of data, {fmt_bytes(_dir_bytes(directory / str(step)))} on disk"
    )
    return 0


def verify(args) -> int:
    from spmd.core.errors import UserError
    from spmd.io import checkpoint as ckpt

    directory, steps = _steps_to_check(args.path)
    if not steps:
        raise UserError(f"no committed checkpoint under {args.path!r}")
    for step in steps:
        n_arrays, n_bytes, unchecked = ckpt.verify(directory, step)
        if unchecked:
            print(f"unchecked: {directory}/{step}: {n_arrays} arrays, {n_bytes:,} bytes read and finite, but "
                  f"{unchecked} could not be checked against its metadata (--trust-unverified)")  # fmt: skip
        else:
            print(f"ok: {directory}/{step}: {n_arrays} arrays, {n_bytes:,} bytes read and checked")
    return 0


def reshard(args) -> int:
    """Restore onto the new mesh and rules (each device reads only its shards), save under dst."""
    from spmd.assembly.config import config_from_json
    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError, check_writable
    from spmd.io import checkpoint as ckpt

    directory, step = ckpt.locate(args.src)
    meta = ckpt.check_meta(directory, step, ckpt.read_meta(directory, step), ("run", "consumed_samples"))
    setup = assemble(config_from_json(meta["run"]["config"]), args.mesh, args.rules, dcn_mesh=args.dcn_mesh)
    dst = pathlib.Path(args.dst)
    check_writable(dst, "reshard destination")
    if (dst / ckpt.SUBDIR / str(step)).exists():
        raise UserError(f"{dst / ckpt.SUBDIR / str(step)} already exists; pick another destination")
    state, meta = ckpt.restore(directory, step, setup.trainer.abstract_saved)
    new = setup.to_json()
    meta["run"] = {**meta["run"], "mesh": new["mesh"], "rules": new["rules"], "devices": new["devices"]}
    writer = ckpt.Checkpointer(dst, setup.cfg.checkpoint)
    writer.save(step, state, meta)
    writer.close()
    print(f"wrote {dst / ckpt.SUBDIR / str(step)} for mesh {args.mesh} and rules {setup.rules.name}")
    return 0


def import_hf(args) -> int:
    from spmd.platform import distributed

    distributed.initialize_from_flags(args)
    import jax

    from spmd.io import hf
    from spmd.parallel.sharding import fmt_bytes

    done = hf.import_hf(
        args.hf_dir, args.run_dir, args.mesh, args.rules, args.set, args.dcn_mesh, args.overwrite
    )
    if jax.process_index():
        return 0
    cfg = done["config"]
    m, fig = cfg.model, cfg.model_family.figures(cfg.model, cfg.train.seq_len)
    tokenizer = f"; tokenizer {', '.join(done['tokenizer'])}" if done["tokenizer"] else "; no tokenizer file"
    print(
        f"imported {done['architecture']} (family {cfg.model_family.name}, {m.n_layers} layers, d_model "
        f"{m.d_model}, vocab {m.vocab_size}{f', {fig.n_experts} experts' if fig.n_experts else ''}): {done['tensors']} tensors, "
        f"{fmt_bytes(done['bytes'])} as {m.param_dtype} -> {args.run_dir}/checkpoints/0{tokenizer}\n"
        f"next: spmd-train --init-from {args.run_dir} --run-dir RUN_DIR  (or spmd-eval --run-dir {args.run_dir}"
        f"{' --data DIR, DIR prepared with its tokenizer' if done['tokenizer'] else ''})"
    )
    return 0


def parse_size(text: str) -> int:
    """'5GB', '500MB', '100KB' or a byte count -> bytes (decimal units, as transformers uses)."""
    from spmd.core.errors import UserError

    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            number = t[: -len(unit)].strip()
            break
    else:
        number, scale = t, 1
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"--max-shard-size {text!r}: give a positive size such as 5GB or 500MB")
    return int(value * scale)


def export_hf(args) -> int:
    from spmd.platform import distributed

    max_shard_bytes = parse_size(args.max_shard_size)
    distributed.initialize_from_flags(args)
    import jax

    from spmd.io import hf
    from spmd.parallel.sharding import fmt_bytes

    if args.adapter:
        from spmd.transforms import lora

        done = lora.export_adapter(args.run_dir, args.out, args.step, args.dtype)
        if not jax.process_index():
            print(
                f"exported the LoRA adapters of step {done['step']} (rank {done['rank']}, "
                f"{', '.join(done['modules'])}): {done['tensors']} tensors -> {args.out}"
            )
        return 0
    done = hf.export_hf(
        args.run_dir, args.out, args.step, args.dtype, args.mesh, args.rules, max_shard_bytes, args.merge
    )
    if jax.process_index():
        return 0
    if done["capacity_note"]:
        log(done["capacity_note"])
    print(
        f"exported step {done['step']} as {done['architecture']}: {done['tensors']} tensors, "
        f"{fmt_bytes(done['bytes'])} in {len(done['files'])} file(s) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
