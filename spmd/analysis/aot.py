"""The dry-run behind `spmd-dryrun`: compile the train step for a mesh without allocating, and
report per device what it holds and which collectives it runs.

    spmd-dryrun --config llama-70b --mesh fsdp=64,tensor=4 --rules fsdp_tp --host-devices 256

Everything is abstract (`ShapeDtypeStruct`s carrying shardings): the fake CPU devices only stand
in for the topology. Figures are from XLA's CPU backend, which emits an FSDP gradient reduction as
all-reduce where GPU/TPU emit reduce-scatter; the communication volume below counts bytes each
device sends over a ring (all-gather and reduce-scatter (n-1)/n of the full array, all-reduce twice
that), so the two forms are comparable.
"""

import math
import os
import re
import sys
import time
import warnings

import jax
import numpy as np

from spmd.core.errors import UserError, stderr_captured
from spmd.core.mesh import MESH_AXES, axes_size, format_mesh, platform_of, spec_axes


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
    """Lower bound on bytes each device sends per step, by parallelism (see module doc):
    FSDP gathers every parameter forward and again backward and reduce-scatters its gradient, in
    the dtype the model uses it in (the compute dtype for the weights it casts:
    ParamInfo.compute_cast; on TPU a float32 matmul at default precision reads its operands as
    bfloat16, and they are gathered as such), except an untied embedding table where moving the
    looked-up rows is less; a sharded weight update reduce-scatters the gradient and gathers the parameter; data
    parallelism (and context parallelism, whose devices see different tokens too) all-reduces the
    gradient of what it replicates; tensor parallelism all-reduces the (B, T, D) activations twice
    per layer forward and twice backward (once more under full remat; an MoE layer's MLP sums
    its dispatched tokens instead, recomputed under remat); expert parallelism moves dispatched
    tokens by all-to-all (forward, backward, and again under remat); context parallelism moves
    keys and values (spmd/parallel/context.py's three modes); a vocabulary split over a non-batch axis sums
    the embedding lookup forward and the logits' input gradient backward; pipeline parallelism
    sends each microbatch's (b, T, D) activations to the next stage once per repeat, forward, and
    their gradients back."""
    sizes = dict(plan.mesh.shape)
    batch_axes = plan.rules.mapping.get("batch", ())
    expert_axes = plan.rules.mapping.get("expert", ())
    seq_axes = tuple(
        a for a in plan.rules.mapping.get("seq", ()) if a not in batch_axes and sizes.get(a, 1) > 1
    )
    grad_axes = batch_axes + seq_axes
    # Pipeline stages hold different layers: a parameter split over them is never gathered.
    stage_axes = plan.schedule.axes if plan.schedule is not None else ()
    m = cfg.model  # the settings every family has: dtype, remat
    fig = plan.family.figures(m, cfg.train.seq_len)
    # Each layer's gathered weights are freed after its forward and gathered again for its
    # backward (there, once for recomputation and gradients both): keeping them instead would hold
    # every layer's unsharded weights from forward to backward, the memory FSDP exists to save.
    # That is ZeRO-3 and FSDP's default (torch's reshard_after_forward); the layers' scan reads the
    # sharded weights in both loops, so the compiler gathers twice with or without remat.
    gathers = 2
    # Tokens on one device as the layers see them, and the layers it runs: under a pipeline, the
    # rows of its stage (the stage axes do not split them there) through n_layers / S layers.
    dp = axes_size(sizes, [a for a in batch_axes if a not in stage_axes])
    n_ctx = axes_size(sizes, seq_axes)
    B, T = cfg.train.global_batch_size // dp, cfg.train.seq_len // n_ctx
    itemsize = np.dtype(m.dtype).itemsize  # activations and cast weights travel in the compute dtype
    # The bytes a matmul reads one weight element as: on TPU, default precision rounds float32
    # operands to bfloat16 (one pass), and the compiler gathers them rounded (seen in its HLO).
    platform = platform_of(plan.mesh)
    read_itemsize = min(itemsize, 2) if platform == "tpu" else itemsize
    # An MoE layer's (B, E, C, D) dispatched tokens (capacity path; the
    # dropless path's padded buffers are larger, spmd/parallel/expert_parallel.py).
    dispatched = math.prod(fig.dispatched_shape(B)) * itemsize if fig.n_experts else 0
    out = {"fsdp": 0.0, "data": 0.0, "tensor": 0.0, "expert": 0.0, "context": 0.0, "stage": 0.0}
    for p in plan.params:
        axes = [a for e in p.spec for a in spec_axes(e)]
        shard = axes_size(sizes, axes)
        # Sharded over a batch axis: FSDP, gathered for compute. Experts split over an axis that
        # also carries the batch are never gathered (expert parallelism moves tokens instead).
        f = axes_size(sizes, [a for a in axes if a in batch_axes and a not in expert_axes + stage_axes])
        # What one device holds after the FSDP gather, in the dtype the model uses it in: a
        # weight cast to the compute dtype is gathered cast (a bf16 model gathers bf16), and its
        # gradient leaves the matmuls, and is reduced, in that dtype too (the cast's transpose
        # comes after the reduction); norm scales and the embedding table are used as stored.
        used = min(1.0, itemsize / p.dtype.itemsize) if p.compute_cast else 1.0
        read = min(1.0, read_itemsize / p.dtype.itemsize) if p.compute_cast else 1.0
        gathered = used * p.bytes_total / (shard / f)
        if f > 1:  # the weights gathered (forward, again in the backward), the gradient reduce-scattered
            cost = (gathers * read / used + 1) * gathered * (f - 1) / f
            if p.logical[:1] == ("vocab",) and not fig.tie_embeddings:
                # The embedding table is only read by the lookup: instead of gathering it, the
                # devices can send each other the pieces of the rows their tokens need, and the
                # rows' gradients back; whichever is less.
                split = [a for a in spec_axes(p.spec[0]) if a in batch_axes] if p.spec else []
                row = gathered / (p.local_shape[0] * axes_size(sizes, split))
                cost = min(cost, 2 * B * T * row * (f - 1) / f)
            out["fsdp"] += cost
        replicas = axes_size(sizes, [a for a in grad_axes if a not in axes])
        # A sharded weight update (shard_optimizer_over) over z of those replicas: the gradient
        # reduce-scattered over them and the updated parameter (parameter dtype) gathered back;
        # over the others all-reduced, each device's part of it.
        z = axes_size(sizes, [a for a in grad_axes if a not in axes and a in plan.rules.shard_optimizer_over])
        grad = gathered / f
        if z > 1:
            out["data"] += (grad + p.bytes_per_device) * (z - 1) / z
            grad, replicas = grad / z, replicas // z
        if replicas > 1:
            out["data"] += 2 * grad * (replicas - 1) / replicas
    act = B * T * fig.d_model * itemsize  # one (B, T, D) activation
    n_layers = fig.n_layers // (plan.schedule.stages if plan.schedule is not None else 1)
    t = sizes.get("tensor", 1)
    if t > 1 and "tensor" in (plan.rules.mapping.get("heads", ()) + plan.rules.mapping.get("mlp", ())):
        # Activations in the compute dtype: the minimum. (XLA:CPU sends bf16 tensors as fp32, so
        # its bf16 figures run up to 2x over this; the TPU compiler sends them as they are.)
        # Two partial sums per layer forward (attention and MLP outputs), two backward. Under full
        # remat the backward recomputes the forward as far as the residual after attention, which
        # the MLP's backward reads: one more (the MLP output's is dead there). Under save_dots the
        # projections' outputs are saved as the program sees them, i.e. already summed.
        attention = 2 + (1 if m.remat == "full" else 0)
        # An MoE layer's MLP is its experts: their partial sums are of the dispatched tokens
        # (B, E, C, D), which the backward also recomputes under any remat (the expert einsums have
        # a batch dimension, so save_dots does not keep them, and combining reads their output).
        n_moe = fig.moe_layers * n_layers // fig.n_layers
        moe = 2 + (1 if m.remat != "none" else 0)
        sums = n_layers * attention * act + (n_layers - n_moe) * 2 * act + n_moe * moe * dispatched
        out["tensor"] = 2 * sums * (t - 1) / t
    # The vocabulary split over an axis that does not carry the batch (Megatron's vocab-parallel
    # embedding and logits): the lookup's rows are summed over it forward (each device has the rows
    # of its part of the vocabulary, zeros elsewhere), and the logits' input gradient backward: two
    # (B, T, D) all-reduces. (The loss's per-token statistics over it, under 1/D of that, are
    # left out.)
    for a in plan.rules.mapping.get("vocab", ()):
        if a not in batch_axes + expert_axes and sizes.get(a, 1) > 1 and a in out:
            out[a] += 2 * 2 * act * (sizes[a] - 1) / sizes[a]
    if n_ctx > 1:
        # Per layer, the local piece's K and V (heads split over tensor where the rules say so).
        t_heads = t if "tensor" in plan.rules.mapping.get("kv_heads", ()) else 1
        kv = 2 * B * T * (fig.n_kv_heads // t_heads) * fig.head_dim * itemsize
        mode = plan.rules.context_parallel
        if mode == "ring":
            # Forward: K/V pass n-1 hops. Backward (kernels/ring_attention.py): K/V again n-1 hops,
            # and their fp32 dK/dV accumulators n hops back home.
            # The keys' int32 positions travel with them, both ways.
            per_layer = 2 * (n_ctx - 1) * (kv + B * T * 4) + n_ctx * kv * 4 / itemsize
        elif mode == "ulysses":
            # q, k, v to head-sharded and o back, forward; their gradients, backward.
            qo = 2 * B * T * (fig.n_heads // t_heads) * fig.head_dim * itemsize
            per_layer = 2 * (qo + kv) * (n_ctx - 1) / n_ctx
        else:  # allgather: gather K/V (and positions) forward, reduce-scatter their gradients backward
            per_layer = 2 * (n_ctx - 1) * kv + (n_ctx - 1) * B * T * 4
        out["context"] = n_layers * per_layer
    n_ep = axes_size(sizes, expert_axes)
    if fig.n_experts and n_ep > 1:
        # Each MoE layer moves its dispatched tokens (B/dp, E, C, D) to the experts and back, forward
        # and backward: 4 all-to-alls, each sending (n-1)/n of the buffer; under remat the backward
        # moves them again (the experts' inputs and outputs are not saved: their einsums have a
        # batch dimension): 6.
        stages = plan.schedule.stages if plan.schedule is not None else 1
        moves = 4 + (2 if m.remat != "none" else 0)
        out["expert"] = moves * fig.moe_layers // stages * dispatched * (n_ep - 1) / n_ep
    schedule = plan.schedule
    if schedule is not None:
        # Every row of the device's batch enters each of its stage's R layer groups once: its
        # activations sent on once per repeat, forward, and their gradient back.
        out["stage"] = 2 * schedule.repeats * B * T * fig.d_model * itemsize
    return out


def pipeline_report(plan, rows) -> dict | None:
    """The schedule, its bubble fraction ((S-1)/(M R + S-1)) and what the compiled step sends
    between stages (collective-permutes over the stage axes), or None without a pipeline."""
    schedule = plan.schedule
    if schedule is None:
        return None
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
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "repeats": schedule.repeats,
        "iterations": schedule.iterations,
        "bubble_fraction": schedule.bubble_fraction,
        "collective_permute_bytes": permute,
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


def dry_run(setup, list_instructions: bool = False, explain: bool = False) -> dict:
    """Compile `setup`'s train step (spmd.assembly.setup.assemble) from abstract inputs and report per device
    what it holds, its model FLOPs and every collective it runs. Allocates nothing."""
    from spmd.analysis import explain as explain_lib
    from spmd.analysis import hlo

    cfg, mesh, rules, plan, trainer = setup.cfg, setup.mesh, setup.rules, setup.plan, setup.trainer
    B, T = cfg.train.global_batch_size, cfg.train.seq_len
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
    items = hlo.collectives(text, mesh)
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
    flops = plan.family.figures(cfg.model, T).flops_per_token * B * T
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
            [f"{slices} slices: transfers between slices (DCN) are not counted below"] if slices > 1 else []
        )
        + replicated,
        "mesh": {a: s for a, s in sizes.items()},
        "rules": rules.name,
        "devices": mesh.size,
        "compile_seconds": compile_s,
        "per_device_bytes": {
            "params": state["params"],
            **({"frozen_params": state["frozen_params"]} if state["frozen_params"] else {}),
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
        "compiled_matmul_flops_per_device": hlo.matmul_flops(text),
        "pipeline": pipeline_report(plan, rows),
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
