"""`spmd-plan`: choose a mesh and rules preset for a model on N devices within a memory budget.

    spmd-plan --config llama-70b --devices 256 --memory-per-device 80GiB [--dcn 4] [--hardware h100]

1. Enumerate meshes (factorisations of N over data, fsdp and tensor; expert too for MoE models;
   any of the five axes with --axes) with the presets whose axes cover them (dp, fsdp, tp,
   fsdp_tp, tp_sp, fsdp_tp_sp, ep, fsdp_ep, cp_ring, cp_ulysses); reject those the rules cannot
   shard (divisibility).
2. Prune by analytic memory: parameters + gradients + optimizer state per device must fit.
3. Rank the rest by a roofline step time: model FLOPs / peak + analytic collective bytes / link
   bandwidth (axes that span hosts, with --dcn, use the DCN bandwidth), compute and communication
   not overlapped (a conservative bound).
4. Dry-run (compile, nothing allocated) down the ranking until --candidates layouts fit (at most
   --max-compiles): reject any whose compiled arguments + temporaries exceed the budget, re-rank
   with the collective bytes the compiled step really sends, and print the top five with their
   reasons.
"""

import argparse
import math
import re
import sys
import types

from spmd.cli import _env_host_devices, _exit_now, _Parser, _set_host_devices

# Dense bf16 peak FLOP/s per device, and link bandwidths in bytes/s per device (one direction),
# from vendor datasheets: NVLink 4 = 450 GB/s, InfiniBand NDR 400 Gb/s = 50 GB/s per GPU;
# TPU v5p ICI ~ 4 x 100 GB/s, DCN ~ 25 GB/s per chip. Override with --peak-tflops, --ici-gbps, --dcn-gbps.
HARDWARE = {
    "h100": {"peak": 989e12, "ici": 450e9, "dcn": 50e9},
    "h200": {"peak": 989e12, "ici": 450e9, "dcn": 50e9},
    "a100": {"peak": 312e12, "ici": 300e9, "dcn": 25e9},
    "tpu-v5p": {"peak": 459e12, "ici": 400e9, "dcn": 25e9},
    "cpu": {"peak": 0.4e12, "ici": 10e9, "dcn": 1e9},
}
# Each preset: the mesh axes it can use, and those it needs (so a candidate is never a simpler preset
# under another name: fsdp_tp on a mesh without tensor would be fsdp).
PRESET_AXES = {
    "dp": {"data"},
    "fsdp": {"data", "fsdp"},
    "tp": {"data", "tensor"},
    "fsdp_tp": {"data", "fsdp", "tensor"},
    "tp_sp": {"data", "tensor"},
    "fsdp_tp_sp": {"data", "fsdp", "tensor"},
    "ep": {"data", "expert", "tensor"},
    "fsdp_ep": {"data", "fsdp", "expert", "tensor"},
    "cp_ring": {"data", "fsdp", "context", "tensor"},
    "cp_ulysses": {"data", "fsdp", "context", "tensor"},
}
REQUIRED = {
    "dp": set(),
    "fsdp": {"fsdp"},
    "tp": {"tensor"},
    "fsdp_tp": {"fsdp", "tensor"},
    "tp_sp": {"tensor"},
    "fsdp_tp_sp": {"fsdp", "tensor"},
    "ep": {"expert"},
    "fsdp_ep": {"fsdp", "expert"},
    "cp_ring": {"context"},
    "cp_ulysses": {"context"},
}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*", text, re.I)
    if not m:
        from spmd.errors import UserError

        raise UserError(f"--memory-per-device must look like 80GiB or 512MiB, got {text!r}")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " ")) if unit else int(float(m.group(1)))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spmd-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--memory-per-device", required=True, help="e.g. 80GiB")
    p.add_argument(
        "--dcn",
        type=int,
        default=1,
        help="hosts (slices) the devices span; cross-host axes use DCN bandwidth",
    )
    p.add_argument("--hardware", default="h100", choices=sorted(HARDWARE))
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--ici-gbps", type=float)
    p.add_argument("--dcn-gbps", type=float)
    p.add_argument(
        "--candidates", type=int, default=6, help="dry-run down the ranking until this many layouts fit [6]"
    )
    p.add_argument(
        "--max-compiles", type=int, help="stop dry-running after this many compiles [4 x --candidates]"
    )
    p.add_argument(
        "--axes",
        help="mesh axes to search, e.g. data,fsdp,context,tensor "
        "[data,fsdp,tensor; with expert for MoE models]",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--host-devices", type=int, default=_env_host_devices(), help="fake CPU devices [--devices]"
    )
    return p


def meshes(n: int, axes=("data", "fsdp", "tensor")):
    """Every way to write n as a product of sizes over `axes` (in that order)."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in (d for d in range(1, n + 1) if n % d == 0):
        for rest in meshes(n // d, axes[1:]):
            yield {axes[0]: d, **rest}


def search_axes(cfg, text: str | None) -> tuple[str, ...]:
    from spmd.errors import UserError
    from spmd.mesh import MESH_AXES

    if text is None:
        wanted = {"data", "fsdp", "tensor"} | ({"expert"} if cfg.model.n_experts else set())
    else:
        wanted = {a.strip() for a in text.split(",") if a.strip()}
        unknown = sorted(wanted - set(MESH_AXES))
        if unknown or not wanted:
            raise UserError(
                f"--axes: unknown mesh axis {', '.join(unknown) or '(none given)'}; "
                f"choose among {', '.join(MESH_AXES)}"
            )
    return tuple(a for a in MESH_AXES if a in wanted)


def enumerate_candidates(cfg, n: int, axes=("data", "fsdp", "tensor")):
    """(mesh spec, preset, plan or None, reason if rejected) for every mesh x preset that covers its axes."""
    from spmd import sharding as sharding_lib
    from spmd.errors import UserError
    from spmd.mesh import build_mesh
    from spmd.rules import load_rules

    rules = {
        preset: load_rules(preset).with_attention(cfg.attention) for preset in PRESET_AXES
    }  # once, not per mesh
    for sizes in meshes(n, axes):
        used = {a for a, s in sizes.items() if s > 1}
        spec = ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "data=1"
        for preset, preset_axes in PRESET_AXES.items():
            if not used <= preset_axes or not REQUIRED[preset] <= used:
                continue
            try:
                plan = sharding_lib.plan(
                    cfg.model,
                    build_mesh(spec),
                    rules[preset],
                    cfg.train.global_batch_size,
                    cfg.train.seq_len,
                    cfg.train.microbatches,
                )
                yield spec, preset, plan, None
            except UserError as e:
                yield spec, preset, None, str(e)


def estimate(cfg, plan, hw, dcn: int, volume: dict | None = None) -> dict:
    from models.llama import flops_per_token
    from spmd.dryrun import analytic_minimum
    from spmd.mesh import MESH_AXES

    sizes = dict(plan.mesh.shape)
    compute = flops_per_token(cfg.model, cfg.train.seq_len) * cfg.train.global_batch_size * cfg.train.seq_len
    compute_s = compute / plan.mesh.size / hw["peak"]
    volume = volume if volume is not None else analytic_minimum(cfg, plan)
    # With several hosts, the outermost axes (data, then fsdp, in MESH_AXES order) are the ones that span them.
    remaining, dcn_axes = dcn, set()
    for axis in MESH_AXES:
        if remaining > 1 and sizes.get(axis, 1) > 1:
            dcn_axes.add(axis)
            remaining = max(1, remaining // math.gcd(remaining, sizes[axis]))
    comm_s = sum(v / (hw["dcn"] if axis in dcn_axes else hw["ici"]) for axis, v in volume.items())
    return {
        "compute_s": compute_s,
        "comm_s": comm_s,
        "step_s": compute_s + comm_s,
        "dcn_axes": sorted(dcn_axes),
    }


def _t(seconds: float) -> str:
    return f"{seconds:.3f}s" if seconds >= 0.1 else f"{seconds * 1e3:.3f}ms"


def run(args) -> int:
    from spmd import dryrun
    from spmd.config import load_config
    from spmd.errors import UserError
    from spmd.sharding import fmt_bytes, tree_bytes_per_device
    from spmd.train import build_trainer

    cfg = load_config(args.config, args.set)
    budget = parse_bytes(args.memory_per_device)
    max_compiles = args.max_compiles if args.max_compiles is not None else 4 * args.candidates
    if min(args.devices, args.dcn, args.candidates, max_compiles) < 1:
        raise UserError("--devices, --dcn, --candidates and --max-compiles must be positive")
    hw = dict(HARDWARE[args.hardware])
    for key, flag, scale in (
        ("peak", "peak_tflops", 1e12),
        ("ici", "ici_gbps", 1e9),
        ("dcn", "dcn_gbps", 1e9),
    ):
        if getattr(args, flag) is not None:
            hw[key] = getattr(args, flag) * scale
    if args.devices % args.dcn:
        raise UserError(f"--devices {args.devices} must divide by --dcn {args.dcn}")

    fits, rejected = [], []
    for spec, preset, plan, reason in enumerate_candidates(cfg, args.devices, search_axes(cfg, args.axes)):
        if plan is None:
            rejected.append((spec, preset, reason))
            continue
        opt = tree_bytes_per_device(build_trainer(cfg, plan).abstract_state["opt_state"])
        static = 2 * plan.param_bytes_per_device + opt
        if static > budget:
            rejected.append(
                (
                    spec,
                    preset,
                    f"params + grads + optimizer state {fmt_bytes(static)} per device "
                    f"> budget {fmt_bytes(budget)}",
                )
            )
            continue
        fits.append(
            {
                "mesh": spec,
                "rules": preset,
                "plan": plan,
                "static": static,
                **estimate(cfg, plan, hw, args.dcn),
            }
        )
    fits.sort(key=lambda c: c["step_s"])

    # The analytic memory above leaves activations out, so at long sequences many of the fastest
    # layouts only fail once compiled: keep going down the ranking until enough fit.
    ranked, compiled = [], 0
    for cand in fits:
        if len(ranked) == args.candidates or compiled == max_compiles:
            break
        compiled += 1
        r = dryrun.run(
            types.SimpleNamespace(
                config=args.config, mesh=cand["mesh"], rules=cand["rules"], set=args.set, list=False
            )
        )
        need = r["per_device_bytes"]["arguments"] + r["per_device_bytes"]["temporaries"]
        if need > budget:
            rejected.append(
                (
                    cand["mesh"],
                    cand["rules"],
                    f"compiled step needs {fmt_bytes(need)} per device "
                    f"(arguments + temporaries) > budget {fmt_bytes(budget)}",
                )
            )
            continue
        by_axis = {}
        for row in r["collectives"]:
            for axis in row["axes"] or ["-"]:
                by_axis[axis] = by_axis.get(axis, 0.0) + row["volume_bytes"] / max(1, len(row["axes"]))
        est = estimate(cfg, cand["plan"], hw, args.dcn, by_axis)
        ranked.append(
            {
                **cand,
                **est,
                "need": need,
                "sent": r["collective_volume_bytes"],
                "compile_s": r["compile_seconds"],
            }
        )
    ranked.sort(key=lambda c: c["step_s"])

    print(
        f"{cfg.name} on {args.devices} devices ({args.hardware}: {hw['peak'] / 1e12:.0f} TFLOP/s, "
        f"ICI {hw['ici'] / 1e9:.0f} GB/s, DCN {hw['dcn'] / 1e9:.0f} GB/s, {args.dcn} host(s)), "
        f"budget {fmt_bytes(budget)} per device\n"
    )
    print("best layouts (dry-run compiled; step time = compute + communication, not overlapped):")
    for i, c in enumerate(ranked[:5], 1):
        print(
            f"  {i}. --mesh {c['mesh']} --rules {c['rules']}: est. step {_t(c['step_s'])} "
            f"(compute {_t(c['compute_s'])} + comm {_t(c['comm_s'])}"
            + (f", DCN axes {','.join(c['dcn_axes'])}" if c["dcn_axes"] else "")
            + f"); "
            f"needs {fmt_bytes(c['need'])} of {fmt_bytes(budget)}; sends {fmt_bytes(c['sent'])}"
        )
    if not ranked:
        print("  none fits; more devices, microbatches (--set train.microbatches=N) or remat would help")
    if len(fits) > compiled:
        print(
            f"  ({len(fits) - compiled} more fit by analytic memory but were not compiled: raise --candidates"
            + (" or --max-compiles)" if compiled == max_compiles else ")")
        )
    print(f"\nrejected ({len(rejected)}):")
    for spec, preset, reason in rejected:
        print(f"  --mesh {spec} --rules {preset}: {reason}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from spmd.errors import UserError, report

    try:
        _set_host_devices(args.host_devices or args.devices)
        return run(args)
    except UserError as e:
        report(e)
        return _exit_now(2)


if __name__ == "__main__":
    sys.exit(main())
