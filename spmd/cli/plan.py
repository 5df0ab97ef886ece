"""`spmd-plan`: choose a mesh and rules preset for a model on N devices within a memory budget
(the search itself is spmd.assembly.planner)."""

import argparse
import sys

from spmd.analysis.hardware import planner_chips
from spmd.cli.common import (
    MAX_HOST_DEVICES,
    Parser,
    add_host_devices,
    run_main,
    set_host_devices,
    set_host_platform,
)


def build_parser() -> argparse.ArgumentParser:
    from spmd.assembly import planner
    from spmd.core.mesh import MESH_AXES

    p = Parser(prog="spmd-plan", description=planner.__doc__.split("\n\n")[0])
    from spmd.core import presets

    configs = ", ".join(presets.names(presets.folder("configs")))
    p.add_argument("--config", default="small", help=f"config preset ({configs}) or a .toml path [small]")
    p.add_argument("--devices", type=int, help="how many devices to plan for [--topology's chips]")
    p.add_argument(
        "--memory-per-device",
        help="memory budget of each device, with a unit: 80GiB, 512MiB, 96GB [--topology's HBM per device]",
    )
    p.add_argument(
        "--topology",
        help="rank on the TPU compiler's memory and collectives for this slice (libtpu: pip install "
        "'.[tpu]'), e.g. v5p:4x4x4; sets --hardware",
    )
    p.add_argument(
        "--dcn",
        type=int,
        help="hosts (slices) the devices span; cross-host axes use DCN bandwidth [GPUs: --devices / "
        "--gpus-per-host; else 1]",
    )
    p.add_argument(
        "--gpus-per-host",
        type=int,
        help="GPUs in one host (one NVLink domain): the axes beyond it cross hosts [--hardware's: 8 for "
        "h100, h200, a100]",
    )
    p.add_argument(
        "--hardware",
        default="h100",
        choices=planner_chips(),
        help="the chip whose peak FLOP/s and link bandwidths rank the layouts [h100]",
    )
    p.add_argument("--peak-tflops", type=float, help="override the chip's peak, in TFLOP/s (bf16 dense)")
    p.add_argument(
        "--ici-gbps", type=float, help="override the chip's bandwidth within a host or slice, in GB/s"
    )
    p.add_argument("--dcn-gbps", type=float, help="override the bandwidth between hosts (slices), in GB/s")
    p.add_argument(
        "--host-gbps",
        type=float,
        default=planner.HOST_BYTES_PER_S / 1e9,
        help=f"device <-> host memory bandwidth, for an offloaded optimizer state, in GB/s [{planner.HOST_BYTES_PER_S / 1e9:g}]",
    )
    p.add_argument(
        "--candidates", type=int, default=6, help="dry-run down the ranking until this many layouts fit [6]"
    )
    p.add_argument(
        "--max-compiles", type=int, help="stop dry-running after this many compiles [4 x --candidates]"
    )
    p.add_argument(
        "--axes",
        help=f"mesh axes to search among {', '.join(MESH_AXES)}, e.g. data,fsdp,context,tensor "
        "[data,fsdp,tensor; with expert for MoE models]",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    add_host_devices(p, "fake CPU devices [--devices]", from_env=True)
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), run, argv)


def _t(seconds: float) -> str:
    return f"{seconds:.3f}s" if seconds >= 0.1 else f"{seconds * 1e3:.3f}ms"


def hosts_of(args) -> int:
    """The hosts the devices span: --dcn as given; for GPUs, --devices / --gpus-per-host (default:
    the chip's GPUs per host); else 1."""
    from spmd.analysis.hardware import CHIPS
    from spmd.core.errors import UserError

    per_host = args.gpus_per_host if args.gpus_per_host is not None else CHIPS[args.hardware].per_host
    if args.gpus_per_host is not None and args.gpus_per_host < 1:
        raise UserError(f"--gpus-per-host must be at least 1, got {args.gpus_per_host}")
    if args.dcn is not None:
        if args.gpus_per_host is not None and args.dcn * args.gpus_per_host != args.devices:
            raise UserError(
                f"--dcn {args.dcn} hosts x --gpus-per-host {args.gpus_per_host} is not --devices "
                f"{args.devices}; give one of --dcn and --gpus-per-host"
            )
        return args.dcn
    if per_host is None or args.devices <= per_host:
        return 1
    if args.devices % per_host:
        raise UserError(
            f"--devices {args.devices} is not a whole number of hosts of {per_host} GPUs; give --devices "
            f"as a multiple of {per_host}, or --gpus-per-host"
        )
    return args.devices // per_host


def run(args) -> int:
    from spmd.assembly import planner
    from spmd.assembly.config import load_config
    from spmd.core.errors import UserError
    from spmd.parallel.sharding import fmt_bytes

    device_list, memory = None, args.memory_per_device
    if args.topology:
        from spmd.analysis import topology

        if args.host_devices is not None:
            raise UserError("--topology and --host-devices both name the devices; give one")
        if args.dcn not in (None, 1) or args.gpus_per_host is not None:
            raise UserError(
                "spmd-plan --topology plans one slice; --dcn and --gpus-per-host are not supported with it"
            )
        set_host_platform()
        device_list = topology.devices(args.topology)
        if args.devices not in (None, len(device_list)):
            raise UserError(f"--devices {args.devices} but --topology {args.topology} has {len(device_list)}")
        args.devices = len(device_list)
        args.hardware = topology.GENERATIONS[topology.parse(args.topology)[0]][0]
        memory = memory or f"{topology.hbm_per_device(args.topology, device_list):.0f}B"
    elif args.devices is None or memory is None:
        raise UserError("give --devices and --memory-per-device (or --topology, which implies both)")
    elif args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    elif args.devices > MAX_HOST_DEVICES and args.host_devices is None:
        raise UserError(
            f"--devices {args.devices:,} is more than the {MAX_HOST_DEVICES} devices spmd-plan can simulate in one "
            f"process; plan a TPU pod with --topology (its real chips), or fewer devices"
        )
    elif args.host_devices is None:
        set_host_devices(args.devices)
    hosts = hosts_of(args)
    cfg = load_config(args.config, args.set)
    budget = planner.parse_bytes(memory)
    hw = planner.hardware(args.hardware, args.peak_tflops, args.ici_gbps, args.dcn_gbps)
    if device_list:
        from spmd.analysis.hardware import cores_per_chip

        hw = {k: v / cores_per_chip(device_list) for k, v in hw.items()}
    if not args.host_gbps > 0:
        raise UserError(f"--host-gbps must be a positive number, got {args.host_gbps}")
    # On fake CPU devices the compiled collectives are XLA:CPU's, not the target's: rank by the
    # analytic bytes of what the target's library runs instead.
    analytic = device_list is None
    found = planner.search(cfg, args.devices, budget, hw, hosts, planner.search_axes(cfg, args.axes), args.candidates,
                        args.max_compiles, device_list, args.host_gbps * 1e9, analytic_comm=analytic)  # fmt: skip

    per_host = f", {args.devices // hosts} per host" if hosts > 1 else ""
    print(
        f"{cfg.name} on {args.devices} devices ({args.hardware}: {hw['peak'] / 1e12:.0f} TFLOP/s, "
        f"ICI {hw['ici'] / 1e9:.0f} GB/s, DCN {hw['dcn'] / 1e9:.0f} GB/s, {hosts} host(s){per_host}), "
        f"budget {fmt_bytes(budget)} per device\n"
        f"planned for: global batch {cfg.train.global_batch_size} x {cfg.train.seq_len} tokens "
        f"(train.global_batch_size, train.seq_len), model.remat={cfg.model.remat}\n"
        + (
            "communication: the analytic bytes of the collectives NCCL runs (each FSDP weight all-gathered, "
            "its gradient reduce-scattered; data-parallel gradients all-reduced), not XLA:CPU's compiled ones "
            "(it all-reduces what GPUs reduce-scatter)\n"
            if analytic
            else "communication: the TPU compiler's compiled collectives\n"
        )
    )
    print("best layouts (dry-run compiled; step time = compute + communication, not overlapped):")
    for i, c in enumerate(found.ranked[:5], 1):
        print(
            f"  {i}. --mesh {c['mesh']} --rules {c['rules']}{planner.sets(c['levers'])}: est. step {_t(c['step_s'])} "
            f"(compute {_t(c['compute_s'])} + comm {_t(c['comm_s'])}"
            + (f", pipeline bubble {c['bubble_fraction']:.0%} counted" if c.get("bubble_fraction") else "")
            + (f", DCN axes {','.join(c['dcn_axes'])}" if c["dcn_axes"] else "")
            + f"); needs {fmt_bytes(c['need'])} of {fmt_bytes(budget)}; sends {fmt_bytes(c['sent'])}"
        )
        if c["why"]:
            print(f"     why: {c['why']}")
        run_cmd = planner.command(args.config, c["mesh"], c["rules"], [*args.set, *c["levers"]], hosts)
        print(f"     run: {run_cmd}")
        for note in c.get("notes", []):
            print(f"     note: {note}")
    if not found.ranked:
        print(
            "  none fits, with remat, microbatches or the optimizer state offloaded either: more devices, "
            "or raise --max-compiles to try more layouts"
        )
    if found.fit_by_analytic_memory > found.compiled:
        max_compiles = args.max_compiles if args.max_compiles is not None else 4 * args.candidates
        print(
            f"  ({found.fit_by_analytic_memory - found.compiled} more fit by analytic memory but were not compiled: "
            "raise --candidates" + (" or --max-compiles)" if found.compiled == max_compiles else ")")
        )
    if found.ranked:
        dcn_s, offers = planner.sync_offers(cfg, found.ranked[0], hw, hosts)
        if offers:
            best = found.ranked[0]
            print(
                f"\nacross hosts: the gradients' all-reduce over data alone takes {_t(dcn_s)} per step over DCN, more "
                f"than layout 1's compute ({_t(best['compute_s'])}); what crosses can be made smaller (docs/slices.md):"
            )
            for setting, sent, price in offers:
                print(f"  {planner.sets(setting).strip()}: {fmt_bytes(sent)} per device per step "
                      f"(est. {_t(sent / hw['dcn'])} over DCN); price: {price}")  # fmt: skip
    print(f"\nrejected ({len(found.rejected)}):")
    for spec, preset, reason in found.rejected:
        print(f"  --mesh {spec} --rules {preset}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
