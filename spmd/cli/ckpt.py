"""`spmd-ckpt`: inspect, verify and reshard checkpoints."""

import argparse
import math
import pathlib
import sys

from spmd.cli.common import Parser, add_host_devices, run_main


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="spmd-ckpt", description="Inspect, verify and reshard spmd-train checkpoints.")
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
    for q in (v, r):
        add_host_devices(q)
    return p


def main(argv=None) -> int:
    commands = {"inspect": inspect, "verify": verify, "reshard": reshard}
    return run_main(build_parser(), lambda args: commands[args.command](args), argv)


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _steps_to_check(path: str):
    from spmd import checkpoint as ckpt

    p = pathlib.Path(path).expanduser()
    directory, step = ckpt.locate(path)
    if p.name.isdigit() and p.parent == directory:
        return directory, [step]
    return directory, ckpt.committed_steps(directory)


def inspect(args) -> int:
    import numpy as np

    from spmd import checkpoint as ckpt
    from spmd.mesh import format_mesh
    from spmd.sharding import fmt_bytes

    directory, step = ckpt.locate(args.path)
    print(f"checkpoints in {directory}:")
    for s in ckpt.committed_steps(directory):
        print(f"  step {s:>8}  committed    {fmt_bytes(_dir_bytes(directory / str(s))):>12}")
    for name in ckpt.uncommitted(directory):
        print(f"  {name}  uncommitted (an interrupted save; never restored)")
    meta = ckpt.read_meta(directory, step)
    run = meta.get("run", {})
    mesh = format_mesh(run.get("mesh", {}).get("shape", {}))
    print(f"\nstep {step}:")
    print(
        f"  written by: config {run.get('config', {}).get('name')}, mesh {mesh}, "
        f"rules {run.get('rules', {}).get('name')}, {run.get('devices', {}).get('count')} devices in "
        f"{run.get('devices', {}).get('processes')} process(es)"
    )
    print(
        f"  data position: {meta['consumed_samples']:,} samples consumed (global batch {meta['global_batch_size']}, "
        f"seq_len {meta['seq_len']}, seed {meta['seed']})"
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
    from spmd import checkpoint as ckpt
    from spmd.errors import UserError

    directory, steps = _steps_to_check(args.path)
    if not steps:
        raise UserError(f"no committed checkpoint under {args.path!r}")
    for step in steps:
        n_arrays, n_bytes = ckpt.verify(directory, step)
        print(f"ok: {directory}/{step}: {n_arrays} arrays, {n_bytes:,} bytes read and checked")
    return 0


def reshard(args) -> int:
    """Restore onto the new mesh and rules (each device reads only its shards), save under dst."""
    from spmd import checkpoint as ckpt
    from spmd.config import config_from_json
    from spmd.errors import UserError
    from spmd.setup import assemble

    directory, step = ckpt.locate(args.src)
    meta = ckpt.read_meta(directory, step)
    setup = assemble(config_from_json(meta["run"]["config"]), args.mesh, args.rules, dcn_mesh=args.dcn_mesh)
    dst = pathlib.Path(args.dst)
    if (dst / ckpt.SUBDIR / str(step)).exists():
        raise UserError(f"{dst / ckpt.SUBDIR / str(step)} already exists; pick another destination")
    state, meta = ckpt.restore(directory, step, setup.trainer.abstract_state)
    new = setup.to_json()
    meta["run"] = {**meta["run"], "mesh": new["mesh"], "rules": new["rules"], "devices": new["devices"]}
    writer = ckpt.Checkpointer(dst, setup.cfg.checkpoint)
    writer.save(step, state, meta)
    writer.close()
    print(f"wrote {dst / ckpt.SUBDIR / str(step)} for mesh {args.mesh} and rules {setup.rules.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
