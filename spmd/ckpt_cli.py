"""`spmd-ckpt`: inspect, verify and reshard checkpoints."""

import argparse
import math
import pathlib
import sys

from spmd.cli import _exit_now, _Parser, _set_host_devices


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spmd-ckpt", description="Inspect, verify and reshard spmd-train checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
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
        q.add_argument("--host-devices", type=int, help="simulate N CPU devices")
    return p


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
    from spmd import checkpoint as ckpt
    from spmd.sharding import fmt_bytes

    directory, step = ckpt.locate(args.path)
    print(f"checkpoints in {directory}:")
    for s in ckpt.committed_steps(directory):
        print(f"  step {s:>8}  committed    {fmt_bytes(_dir_bytes(directory / str(s))):>12}")
    for name in ckpt.uncommitted(directory):
        print(f"  {name}  uncommitted (an interrupted save; never restored)")
    meta = ckpt.read_meta(directory, step)
    run = meta.get("run", {})
    mesh = (
        ",".join(f"{a}={n}" for a, n in run.get("mesh", {}).get("shape", {}).items() if n > 1)
        or "single device"
    )
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
        import numpy as np

        n = math.prod(shape) * np.dtype(dtype).itemsize
        total += n
        print(f"    {key.ljust(width)}  {str(shape):>22}  {dtype:>8}  {fmt_bytes(n):>12}")
    print(
        f"  {len(arrays)} arrays, {fmt_bytes(total)} of data, {fmt_bytes(_dir_bytes(directory / str(step)))} on disk"
    )
    return 0


def verify(args) -> int:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from spmd import checkpoint as ckpt
    from spmd.errors import UserError, stderr_parked

    directory, steps = _steps_to_check(args.path)
    if not steps:
        raise UserError(f"no committed checkpoint under {args.path!r}")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for step in steps:
        ckpt.read_meta(directory, step)
        ckpt.saved_arrays(directory, step)  # readable metadata
        manager = ckpt._manager(directory, read_only=True)
        metadata = manager.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
        try:
            with stderr_parked():
                state = manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
                )["state"]
        except Exception as e:  # noqa: BLE001 (the manager stays open: see checkpoint.restore)
            raise UserError(f"checkpoint {directory}/{step} is corrupt: {ckpt._first_line(e)}") from None
        manager.close()
        n_bytes = 0
        for (path, m), x in zip(jax.tree_util.tree_leaves_with_path(metadata), jax.tree.leaves(state)):
            x = np.asarray(x)
            if x.shape != tuple(m.shape) or x.dtype != np.dtype(m.dtype):
                raise UserError(
                    f"checkpoint {directory}/{step}: {ckpt._key(path)} reads as {x.dtype}{list(x.shape)} "
                    f"but its metadata says {m.dtype}{list(m.shape)}"
                )
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                raise UserError(f"checkpoint {directory}/{step}: {ckpt._key(path)} holds NaN or Inf")
            n_bytes += x.nbytes
        print(
            f"ok: {directory}/{step}: {len(jax.tree.leaves(state))} arrays, {n_bytes:,} bytes read and checked"
        )
    return 0


def reshard(args) -> int:
    import jax

    from spmd import checkpoint as ckpt
    from spmd import sharding as sharding_lib
    from spmd.config import config_from_json
    from spmd.errors import UserError
    from spmd.mesh import build_mesh
    from spmd.rules import load_rules
    from spmd.train import build_trainer

    directory, step = ckpt.locate(args.src)
    meta = ckpt.read_meta(directory, step)
    cfg = config_from_json(meta["run"]["config"])
    mesh = build_mesh(args.mesh, args.dcn_mesh)
    rules = load_rules(args.rules)
    plan = sharding_lib.plan(
        cfg.model, mesh, rules, cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.microbatches
    )
    trainer = build_trainer(cfg, plan)
    dst = pathlib.Path(args.dst)
    if (dst / ckpt.SUBDIR / str(step)).exists():
        raise UserError(f"{dst / ckpt.SUBDIR / str(step)} already exists; pick another destination")
    state, meta = ckpt.restore(directory, step, trainer.abstract_state)
    meta["run"] = {
        **meta["run"],
        "mesh": {"spec": args.mesh, "dcn_spec": args.dcn_mesh, "shape": dict(mesh.shape)},
        "rules": rules.to_json(),
        "devices": {
            "count": jax.device_count(),
            "processes": jax.process_count(),
            "platform": jax.devices()[0].platform,
            "kind": jax.devices()[0].device_kind,
        },
    }
    writer = ckpt.Checkpointer(dst, cfg.checkpoint)
    writer.save(step, state, meta)
    writer.close()
    print(f"wrote {dst / ckpt.SUBDIR / str(step)} for mesh {args.mesh} and rules {rules.name}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from spmd.errors import UserError, report

    try:
        if getattr(args, "host_devices", None) is not None:
            _set_host_devices(args.host_devices)
        return {"inspect": inspect, "verify": verify, "reshard": reshard}[args.command](args)
    except UserError as e:
        report(e)
        return _exit_now(2)


if __name__ == "__main__":
    sys.exit(main())
