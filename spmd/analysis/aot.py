"""The dry-run behind `spmd-dryrun`: compile the train step for a mesh without allocating, and
report per device what it holds and which collectives it runs.

    spmd-dryrun --config llama-70b --mesh fsdp=64,tensor=4 --rules fsdp_tp --host-devices 256

Everything is abstract (`ShapeDtypeStruct`s carrying shardings): the fake CPU devices only stand
in for the topology. Figures are from XLA's CPU backend, which emits an FSDP gradient reduction as
all-reduce where GPU/TPU emit reduce-scatter; the communication volume below counts bytes each
device sends over a ring (all-gather and reduce-scatter (n-1)/n of the full array, all-reduce twice
that), so the two forms are comparable.
"""

import collections
import os
import re
import sys
import time
import warnings

import jax

from spmd.core.errors import UserError, stderr_captured
from spmd.core.mesh import MESH_AXES, axes_size, format_mesh, platform_of, split_over_hosts
from spmd.parallel import scheduled, strategy


def ring_volume(kind: str, result_bytes: int, group: int) -> float:
    """Bytes one device sends for one execution (ring algorithms)."""
    if group <= 1:
        return 0.0
    frac = (group - 1) / group
    if kind == "all-reduce":
        return 2 * frac * result_bytes
    if kind == "reduce-scatter":
        return frac * result_bytes * group  # the result is one shard of the reduced array
    if kind == "collective-permute":
        return float(result_bytes)
    return frac * result_bytes  # all-gather (result: the gathered array), all-to-all


def analytic_minimum(cfg, plan) -> dict[str, float]:
    """Lower bound on bytes each device sends per step, by parallelism strategy: the sum over the
    strategies of spmd.parallel (each module's `minimum`, spmd.parallel.strategy)."""
    return strategy.analytic_minimum(cfg, plan)


def pipeline_report(plan, rows, items) -> dict | None:
    """The schedule, its bubble fraction analytic and counted, the microbatch chunks a stage holds
    at once, and what the compiled step sends between stages (collective-permutes over the stage
    axes), or None without a pipeline.

    Counted: GPipe's and circular's forward loop moves one microbatch chunk to the next stage
    every tick by one collective-permute of the stage axes (the schedule's rotation, `ppermute`),
    and autodiff's backward its gradient back; their executions in the compiled step, loop trip
    counts multiplied in, are the ticks each pass took, of which R M did work. The pass's last
    move, which nothing reads, may be left out by the compiler where that tick is not in a loop:
    each pass is counted as the longer of the two. The scheduled pipelines, whose stages diverge,
    run one pass of a stage in each tick and move each way only the pairs of stages that send in
    it, one conditional per direction over the table's sets of pairs (`scheduled.Ticks.moves`),
    each set's permute counted at its share of the ticks: their ticks are the loop's trips, any
    move's count over its set's share; 2 R M (F and a whole backward) or 3 R M (F, B and W) of
    each stage's slots work. Bytes: the permutes' per device as the collectives table counts them
    (a scheduled move's execution as if every device sent), and the moves' of the busiest stage,
    each scheduled move counted only on the stages that send in it (`Ticks.move_senders`)."""
    schedule = plan.schedule
    if schedule is None:
        return None
    shares = schedule.ticks.branch_shares if schedule.scheduled else {}
    senders = schedule.ticks.move_senders if schedule.scheduled else {}
    ticks = {"forward": 0, "backward": 0}
    sent_by_stage = [0.0] * schedule.stages  # what each stage's devices send between stages
    for c in items:
        if c.kind == "collective-permute" and set(c.axes) <= set(schedule.axes) and "ppermute" in c.op_name:
            backward = "transpose(" in c.op_name or scheduled.BACKWARD_SCOPE in c.op_name
            way = "backward" if backward else "forward"
            scope = next((scope for scope in shares if f"/{scope}/" in f"/{c.op_name}/"), None)
            if scope in senders:  # a move of a scheduled pipeline: the tick loop's trips
                ticks[way] = max(ticks[way], round(c.count / shares[scope]))
            else:
                ticks[way] += c.count
            for s in senders.get(scope, range(schedule.stages)):  # the lockstep loop: every stage
                sent_by_stage[s] += c.bytes * c.count
    per_pass = max(ticks.values())
    work = schedule.repeats * schedule.microbatches
    if schedule.scheduled:  # one pass slot per stage and tick
        work *= schedule.ticks.table.passes
    bubble = 1 - work / per_pass if per_pass else None
    permute = sum(
        r["volume_bytes"]
        for r in rows
        if r["kind"] == "collective-permute" and set(r["axes"]) <= set(schedule.axes)
    )
    other = sum(
        r["volume_bytes"]
        for r in rows
        if r["kind"] != "collective-permute" and set(r["axes"]) & set(schedule.axes)
    )
    return {
        "schedule": schedule.name,
        # the stages apart, each tick's pass scheduled (an idle tick computes nothing), or
        # GPipe's and circular's lockstep loop with autodiff's backward
        "backward": "scheduled" if schedule.scheduled else "lockstep",
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "repeats": schedule.repeats,
        "iterations": schedule.iterations,
        "bubble_fraction": schedule.bubble_fraction,
        "bubble_formula": schedule.bubble_formula,
        "ticks_counted": ticks,
        "bubble_counted": bubble,
        "in_flight": schedule.in_flight,
        # per device, a scheduled move counted as every device sending (the permute's result
        # bytes per execution, as the collectives table counts it)
        "collective_permute_bytes": permute,
        # what each device of the busiest stage sends by the moves: a scheduled move counted only
        # on the stages in its set of pairs
        "collective_permute_bytes_busiest": max(sent_by_stage),
        "other_stage_bytes": other,
    }


class DoesNotFit(UserError):
    """The compiler refused the step: it cannot fit the device's memory."""


def peak_bytes(mem, host: int = 0) -> int:
    """A compiled step's peak device bytes per device from its memory_analysis(): arguments +
    outputs - aliased (donated state counted once) + temporaries, less `host`, the bytes of
    donated state kept in host memory, where the backend counts them with the device's (XLA:CPU
    reports no host figures; TPU and GPU compilers report them apart). XLA:CPU's own
    `peak_memory_in_bytes` leaves the temporaries out (llama-70b on fsdp=32,tensor=8: 3.10 GiB
    against 205 GiB of temporaries), so it is not used."""
    split = mem.host_argument_size_in_bytes or mem.host_output_size_in_bytes
    return (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
        - (0 if split else host)
    )


def estimate(cfg, plan, hw: dict, dcn: int, volume: dict | None = None) -> dict:
    """Roofline step time: compute at `hw["peak"]` (stretched by a pipeline's bubble: each stage
    idles (S-1)/(M R + S-1) of the step) plus each axis's bytes (default: the analytic minimum)
    over its link, ICI or, for the outermost axes spanning `dcn` hosts, DCN."""
    sizes = dict(plan.mesh.shape)
    flops_per_token = plan.family.figures(cfg.model, cfg.train.seq_len).flops_per_token
    compute = flops_per_token * cfg.train.global_batch_size * cfg.train.seq_len
    bubble = plan.schedule.bubble_fraction if plan.schedule is not None else 0.0
    compute_s = compute / plan.mesh.size / hw["peak"] / (1 - bubble)
    volume = volume if volume is not None else analytic_minimum(cfg, plan)
    # With several hosts, the outermost axes (data, then fsdp, in MESH_AXES order) are the ones that
    # span them: those that take a factor of the hosts, and any before the last of those (sharing no
    # factor with the hosts, its devices straddle their boundaries).
    across = split_over_hosts(sizes, dcn)[0]
    last = max((MESH_AXES.index(a) for a in across), default=-1)
    dcn_axes = {a for a in MESH_AXES[: last + 1] if sizes.get(a, 1) > 1}
    comm_s = sum(v / (hw["dcn"] if axis in dcn_axes else hw["ici"]) for axis, v in volume.items())
    return {
        "sent_bytes": sum(volume.values()),
        "compute_s": compute_s,
        "comm_s": comm_s,
        "step_s": compute_s + comm_s,
        "bubble_fraction": bubble,
        "dcn_axes": sorted(dcn_axes),
    }


def volume_by_axis(rows) -> dict[str, float]:
    """Bytes sent per mesh axis from dry_run's collective rows (a collective over several axes
    counted evenly against each; "-" for none)."""
    by_axis = {}
    for row in rows:
        for axis in row["axes"] or ["-"]:
            by_axis[axis] = by_axis.get(axis, 0.0) + row["volume_bytes"] / max(1, len(row["axes"]))
    return by_axis


def chip_estimate(setup, rows, flops: float, peak: int, slices: int = 1) -> dict | None:
    """For TPU devices (spmd.analysis.topology): the chip, its HBM per device against the compiled peak,
    and a roofline step time from its datasheet (compute at peak plus each axis's compiled bytes
    over ICI, or DCN for the axes that span slices); None for other devices."""
    from spmd.analysis import hardware

    device = setup.mesh.devices.flat[0]
    if device.platform != "tpu":
        return None
    name, chip = hardware.chip_for(device.device_kind)
    cores = hardware.cores_per_chip(setup.mesh.devices.flat)
    hbm = chip.hbm_bytes / cores
    hw = {
        "peak": chip.peak_flops / cores,
        "ici": chip.ici_bytes_per_s / cores,
        "dcn": chip.dcn_bytes_per_s / cores,
    }
    est = estimate(setup.cfg, setup.plan, hw, slices, volume_by_axis(rows))
    return {
        "chip": name,
        "device_kind": device.device_kind,
        "hbm_per_device": hbm,
        "fits": peak <= hbm,
        **est,
        "mfu": flops / setup.mesh.size / hw["peak"] / est["step_s"],
        "hardware": hw,
    }


# Compile-only devices (spmd.analysis.topology) cannot load an executable: where JAX's persistent compilation
# cache is on, a program compiled before is found there, fails to load ("PjRtCompiler must be
# constructed with a Client") and JAX compiles it again, after a warning the user cannot act on.
_COMPILE_ONLY_CACHE_READ = (
    r"Error reading persistent compilation cache entry.*PjRtCompiler must be constructed"
)


# XLA's partitioner, where it reaches a sharding only by replicating a tensor and cutting it again.
_REPLICATED = re.compile(
    r"cannot go from sharding (.*?) to (.*?) efficiently for HLO operation %\S+ = (\w+\[[\d,]*\])"
)


def partitioner_replications(log: str, rules, sizes: dict) -> list[str]:
    """A line for each tensor XLA's partitioner replicated to reshard it ("Involuntary full
    rematerialization"), naming its shape, the two shardings and the logical names the rules map
    onto the mesh axes involved; the compiler's other log lines go on to stderr."""
    lines, rest = [], []
    for line in log.splitlines(keepends=True):
        m = _REPLICATED.search(line)
        if not m:
            rest.append(line)
            continue
        # The axes a sharding's dimensions name (after the mesh it lists: "mesh[...], [{'fsdp'}, {}]").
        dims = "".join(s.split("], ", 1)[1] if "mesh[" in s else "" for s in (m.group(1), m.group(2)))
        axes = [a for a in MESH_AXES if sizes.get(a, 1) > 1 and f"'{a}'" in dims]
        names = sorted({n for n, mapped in rules.mapping.items() for a in mapped if a in axes})
        rule_list = ", ".join(f"{n} -> {'/'.join(rules.mapping[n])}" for n in names)
        lines.append(
            f"the partitioner replicates a {m.group(3)} tensor to move it from {m.group(1)} to {m.group(2)} "
            f"(every device holds it whole for a moment); the rules that map onto {', '.join(axes) or 'these axes'}: {rule_list}"
        )
    if rest:
        sys.stderr.write("".join(rest))
        sys.stderr.flush()
    return sorted(set(lines))


def between_slices(setup, text: str, slices: int) -> dict | None:
    """What one device sends to the other slices per step: the TPU compiler's megascale sends
    across `slices` slices, or on one slice (slices simulated on one backend) the collectives over
    exactly the [sync] axes. A [sync] method's syncs (conditional branches) per sync, and
    amortised over its H steps; beside it the analytic figure (spmd.parallel.slices)."""
    from spmd.analysis import hlo
    from spmd.parallel import slices as slices_lib

    cfg, mesh, plan = setup.cfg, setup.mesh, setup.plan
    axes = cfg.sync.axis_names()
    if slices > 1:
        n = slices

        def sent(all_branches):
            by = collections.Counter()
            for t in hlo.slice_sends(text, all_branches):
                by[t.dtype] += t.bytes * t.count
            return by
    elif axes:
        n = axes_size(dict(mesh.shape), axes)

        def sent(all_branches):
            by = collections.Counter()
            for c in hlo.collectives(text, mesh, all_branches):
                if set(c.axes) == set(axes):
                    by[c.dtypes[0] if c.dtypes else "?"] += ring_volume(c.kind, c.bytes, n) * c.count
            return by
    else:
        return None
    every, everything = sent(False), sent(True)
    per_sync = {k: everything[k] - every.get(k, 0) for k in everything if everything[k] > every.get(k, 0)}
    H = cfg.sync.inner_steps if cfg.sync.diloco else 1
    views = None
    if cfg.sync.compress == "powersgd":
        views = slices_lib.matrix_views(plan, lambda t: setup.trainer.partition.split(t)[0], cfg.sync.rank)
    analytic = slices_lib.analytic_sent(cfg, plan, n, views)
    per_step = sum(every.values())
    return {
        "slices": n,
        "method": cfg.sync.method,
        "compress": cfg.sync.compress,
        "sent_bytes_per_step": per_step,
        "sent_bytes_per_sync": sum(per_sync.values()),
        "inner_steps": H,
        "amortised_bytes_per_step": per_step + sum(per_sync.values()) / H,
        "by_dtype": dict(every),
        "by_dtype_per_sync": per_sync,
        "analytic_bytes_per_step": analytic["sync"],
        "analytic_allreduce_bytes_per_step": analytic["allreduce"],
    }


def dry_run(setup, list_instructions: bool = False, explain: bool = False) -> dict:
    """Compile `setup`'s train step (spmd.assembly.setup.assemble) from abstract inputs and report per device
    what it holds, its model FLOPs and every collective it runs. Allocates nothing."""
    from spmd.analysis import explain as explain_lib
    from spmd.analysis import hlo

    cfg, mesh, rules, plan, trainer = setup.cfg, setup.mesh, setup.rules, setup.plan, setup.trainer
    B, T = cfg.train.sequences, cfg.train.seq_len
    state = trainer.abstract_state
    batch = trainer.abstract_batch(B, T)
    t0 = time.perf_counter()
    lowered = trainer.train_step.lower(state, batch)
    try:
        with warnings.catch_warnings(), stderr_captured() as log:
            warnings.filterwarnings("ignore", message=_COMPILE_ONLY_CACHE_READ)
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        # The TPU compiler refuses a program that cannot fit the chip's memory (XLA:CPU never does).
        # Told to compile it anyway (--over-hbm), it does so for v5p; for v5e it has been seen to
        # fail as "Invalid TPU program" instead.
        if "Invalid TPU program" in str(e) and "no_crash_on_oom" in os.environ.get("LIBTPU_INIT_ARGS", ""):
            raise DoesNotFit(
                f"{cfg.name} on {format_mesh(dict(mesh.shape))} with rules {rules.name}: the TPU compiler "
                f"could not compile it over {mesh.devices.flat[0].device_kind}'s HBM (--over-hbm): "
                "Invalid TPU program; without --over-hbm it says by how much it does not fit"
            ) from None
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        detail = str(e).split("CompileTimeHbmOom: ")[-1].split(" HLO module")[0].strip().rstrip(".")
        raise DoesNotFit(
            f"{cfg.name} on {format_mesh(dict(mesh.shape))} with rules {rules.name} does not fit "
            f"{mesh.devices.flat[0].device_kind}: {detail}; more devices, fsdp, train.microbatches=N "
            "or model.remat=full would help"
        ) from None
    finally:
        replicated = partitioner_replications(log[0] if log else "", rules, dict(mesh.shape))
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    text = compiled.as_text()  # printed once: large for big models, read by both parsers
    shares = plan.schedule.ticks.branch_shares if plan.schedule and plan.schedule.scheduled else None
    items = hlo.collectives(text, mesh, taken=shares)
    sizes = dict(mesh.shape)
    rows = []
    for (kind, axes), v in sorted(hlo.summarize(items).items()):
        group = axes_size(sizes, axes)
        volume = sum(
            ring_volume(c.kind, c.bytes, group) * c.count for c in items if (c.kind, c.axes) == (kind, axes)
        )
        rows.append(
            {
                "kind": kind,
                "axes": list(axes),
                "count": v["count"],
                "result_bytes": v["bytes"],
                "volume_bytes": volume,
            }
        )
    minimum = analytic_minimum(cfg, plan)
    state = trainer.state_bytes()
    host = state["optimizer_state_on_host"]
    figures = plan.family.figures(cfg.model, T)
    flops = figures.flops_per_token * B * T
    slices = len({getattr(d, "slice_index", 0) for d in mesh.devices.flat})
    peak = peak_bytes(mem, host)
    return {
        "config": cfg.name,
        "platform": platform_of(mesh),
        "device_kind": mesh.devices.flat[0].device_kind,
        "chip_estimate": chip_estimate(setup, rows, flops, peak, slices),
        # Across TPU slices the compiler moves data with send/recv pairs (megascale), which the
        # collective table does not read: the bytes between slices are missing from it.
        "notes": (
            [
                f"{slices} slices: transfers between slices (DCN) are not in the collectives below (see between slices)"
            ]
            if slices > 1
            else []
        )
        + replicated,
        "mesh": {a: s for a, s in sizes.items()},
        "rules": rules.name,
        "devices": mesh.size,
        "compile_seconds": compile_s,
        "per_device_bytes": {
            "params": state["params"],
            **({"frozen_params": state["frozen_params"]} if state["frozen_params"] else {}),
            **({"reference_params": state["reference_params"]} if state["reference_params"] else {}),
            "optimizer_state": state["optimizer_state"],
            "gradients": state["gradients"],
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
            "aliased": mem.alias_size_in_bytes,
            "peak": peak,  # device memory
            "host": max(host, mem.host_argument_size_in_bytes + mem.host_temp_size_in_bytes),
        },
        "optimizer_state_by_kind": state["optimizer_state_by_kind"],
        "model_flops_per_step": flops,
        "model_flops_per_device": flops / mesh.size,
        # What the program runs: recomputation and idle pipeline stages included.
        "compiled_matmul_flops_per_device": hlo.matmul_flops(text, shares),
        # Attention is the model's only Pallas kernel: its launches per step, and per layer.
        "kernel_calls_per_step": (calls := hlo.kernel_calls(text)),
        "kernel_calls_per_layer": calls / figures.n_layers,
        "pipeline": pipeline_report(plan, rows, items),
        "between_slices": between_slices(setup, text, slices),
        "collectives": rows,
        "collective_volume_bytes": sum(r["volume_bytes"] for r in rows),
        "analytic_minimum_bytes": minimum,
        "analytic_minimum_total": sum(minimum.values()),
        "explain": explain_lib.explain(
            setup, items, [ring_volume(c.kind, c.bytes, axes_size(sizes, c.axes)) * c.count for c in items]
        )
        if explain
        else None,
        "instructions": [
            {
                "name": c.name,
                "kind": c.kind,
                "axes": list(c.axes),
                "bytes": c.bytes,
                "count": c.count,
                "computation": c.computation,
            }
            for c in items
        ]
        if list_instructions
        else None,
    }
