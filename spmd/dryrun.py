"""`spmd-dryrun`: compile the train step for a mesh without allocating, and report per device what
it holds and which collectives it runs.

    spmd-dryrun --config llama-70b --mesh fsdp=64,tensor=4 --rules fsdp_tp --host-devices 256

Everything is abstract (`ShapeDtypeStruct`s carrying shardings): the fake CPU devices only stand
in for the topology. Figures are from XLA's CPU backend, which emits an FSDP gradient reduction as
all-reduce where GPU/TPU emit reduce-scatter; the communication volume below counts bytes each
device sends over a ring (all-gather and reduce-scatter (n-1)/n of the full array, all-reduce twice
that), so the two forms are comparable.
"""

import argparse
import json
import math
import sys
import time

import numpy as np

from spmd.cli import _env_host_devices, _exit_now, _Parser, _set_host_devices


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="spmd-dryrun",
        description="Per-device memory, FLOPs and collectives of a train step, "
        "compiled for a mesh without allocating anything.",
    )
    p.add_argument("--config", default="small")
    p.add_argument("--mesh", default="fsdp=-1")
    p.add_argument("--rules", default="fsdp")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--host-devices",
        type=int,
        default=_env_host_devices(),
        help="fake CPU devices standing in for the topology",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--list", action="store_true", help="also list every collective instruction")
    return p


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
    FSDP gathers every parameter forward and backward and reduce-scatters its gradient; data
    parallelism (and context parallelism, whose devices see different tokens too) all-reduces the
    gradient of what it replicates; tensor parallelism all-reduces the (B, T, D) activations twice
    per layer forward and twice backward; expert parallelism moves dispatched tokens by all-to-all;
    context parallelism moves keys and values (spmd/context.py's three modes)."""
    sizes = dict(plan.mesh.shape)
    batch_axes = plan.rules.mapping.get("batch", ())
    expert_axes = plan.rules.mapping.get("expert", ())
    seq_axes = tuple(
        a for a in plan.rules.mapping.get("seq", ()) if a not in batch_axes and sizes.get(a, 1) > 1
    )
    grad_axes = batch_axes + seq_axes
    m = cfg.model
    out = {"fsdp": 0.0, "data": 0.0, "tensor": 0.0, "expert": 0.0, "context": 0.0}
    for p in plan.params:
        axes = [a for e in p.spec if e for a in ((e,) if isinstance(e, str) else e)]
        shard = math.prod(sizes[a] for a in axes)
        # Sharded over a batch axis: FSDP, gathered for compute. Experts split over an axis that
        # also carries the batch are never gathered (expert parallelism moves tokens instead).
        f = math.prod(sizes[a] for a in axes if a in batch_axes and a not in expert_axes)
        gathered = p.bytes_total / (shard / f)  # what one device holds after the FSDP gather
        if f > 1:
            out["fsdp"] += 3 * gathered * (f - 1) / f
        replicas = math.prod(sizes[a] for a in grad_axes if a not in axes)
        if replicas > 1:
            out["data"] += 2 * (gathered / f) * (replicas - 1) / replicas
    dp = math.prod(sizes[a] for a in batch_axes)
    n_ctx = math.prod(sizes[a] for a in seq_axes)
    B, T = cfg.train.global_batch_size // dp, cfg.train.seq_len // n_ctx  # tokens on one device
    t = sizes.get("tensor", 1)
    if t > 1 and "tensor" in (plan.rules.mapping.get("heads", ()) + plan.rules.mapping.get("mlp", ())):
        act = B * T * m.d_model * 4  # fp32 activations
        out["tensor"] = 4 * m.n_layers * 2 * act * (t - 1) / t
    if n_ctx > 1:
        # Per layer, the local piece's K and V (heads split over tensor where the rules say so).
        t_heads = t if "tensor" in plan.rules.mapping.get("kv_heads", ()) else 1
        itemsize = np.dtype(m.dtype).itemsize
        kv = 2 * B * T * (m.n_kv_heads // t_heads) * m.head_dim * itemsize
        mode = plan.rules.context_parallel
        if mode == "ring":
            # Forward: K/V pass n-1 hops. Backward (kernels/ring_attention.py): K/V again n-1 hops,
            # and their fp32 dK/dV accumulators n hops back home.
            # The keys' int32 positions travel with them, both ways.
            per_layer = 2 * (n_ctx - 1) * (kv + B * T * 4) + n_ctx * kv * 4 / itemsize
        elif mode == "ulysses":
            # q, k, v to head-sharded and o back, forward; their gradients, backward.
            qo = 2 * B * T * (m.n_heads // t_heads) * m.head_dim * itemsize
            per_layer = 2 * (qo + kv) * (n_ctx - 1) / n_ctx
        else:  # allgather: gather K/V (and positions) forward, reduce-scatter their gradients backward
            per_layer = 2 * (n_ctx - 1) * kv + (n_ctx - 1) * B * T * 4
        out["context"] = m.n_layers * per_layer
    n_ep = math.prod(sizes[a] for a in expert_axes)
    if m.n_experts and n_ep > 1:
        # Each MoE layer moves its dispatched tokens (B/dp, E, C, D) to the experts and back, forward
        # and backward: 4 all-to-alls, each sending (n-1)/n of the buffer. Capacity path; the
        # dropless path's padded buffers are larger (spmd/moe.py).
        from models.llama import layer_groups
        from models.moe import capacity

        C = capacity(cfg.train.seq_len, m.n_experts, m.top_k, m.capacity_factor)
        buffer = cfg.train.global_batch_size // dp * m.n_experts * C * m.d_model * np.dtype(m.dtype).itemsize
        out["expert"] = 4 * layer_groups(m)[0] * buffer * (n_ep - 1) / n_ep
    return out


def run(args) -> dict:

    from models.llama import flops_per_token
    from spmd import hlo
    from spmd import sharding as sharding_lib
    from spmd.config import load_config
    from spmd.mesh import build_mesh
    from spmd.rules import load_rules
    from spmd.train import build_trainer

    cfg = load_config(args.config, args.set)
    mesh = build_mesh(args.mesh)
    rules = load_rules(args.rules).with_attention(cfg.attention)
    plan = sharding_lib.plan(
        cfg.model, mesh, rules, cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.microbatches
    )
    trainer = build_trainer(cfg, plan)
    B, T = cfg.train.global_batch_size, cfg.train.seq_len
    state = trainer.abstract_state
    batch = trainer.abstract_batch(B, T)
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    items = hlo.collectives(compiled.as_text(), mesh)
    sizes = dict(mesh.shape)
    rows = []
    for (kind, axes), v in sorted(hlo.summarize(items).items()):
        group = math.prod(sizes[a] for a in axes)
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
    opt_bytes = sharding_lib.tree_bytes_per_device(trainer.abstract_state["opt_state"])
    flops = flops_per_token(cfg.model, T) * B * T
    return {
        "config": cfg.name,
        "mesh": {a: s for a, s in sizes.items()},
        "rules": rules.name,
        "devices": mesh.size,
        "compile_seconds": compile_s,
        "per_device_bytes": {
            "params": plan.param_bytes_per_device,
            "optimizer_state": opt_bytes,
            "gradients": plan.param_bytes_per_device,
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
            "peak": mem.peak_memory_in_bytes,
        },
        "model_flops_per_step": flops,
        "model_flops_per_device": flops / mesh.size,
        "collectives": rows,
        "collective_volume_bytes": sum(r["volume_bytes"] for r in rows),
        "analytic_minimum_bytes": minimum,
        "analytic_minimum_total": sum(minimum.values()),
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
        if args.list
        else None,
    }


def print_report(r: dict) -> None:
    from spmd.sharding import fmt_bytes

    mesh = ",".join(f"{a}={s}" for a, s in r["mesh"].items() if s > 1) or "single device"
    print(
        f"{r['config']} on {mesh} ({r['devices']} devices), rules {r['rules']}: compiled in {r['compile_seconds']:.1f}s\n"
    )
    print("per device:")
    for k, v in r["per_device_bytes"].items():
        print(f"  {k:<16} {fmt_bytes(v):>12}")
    print(
        f"  model FLOPs      {r['model_flops_per_device'] / 1e9:,.3f} GFLOP per step "
        f"({r['model_flops_per_step'] / 1e9:,.3f} in all)\n"
    )
    print("collectives per step (XLA CPU backend), per device:")
    print(f"  {'kind':<20} {'mesh axes':<18} {'count':>7} {'result bytes':>14} {'sent (ring)':>14}")
    for row in r["collectives"]:
        print(
            f"  {row['kind']:<20} {','.join(row['axes']) or '-':<18} {row['count']:>7} "
            f"{fmt_bytes(row['result_bytes']):>14} {fmt_bytes(row['volume_bytes']):>14}"
        )
    total, minimum = r["collective_volume_bytes"], r["analytic_minimum_total"]
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r["analytic_minimum_bytes"].items() if v)
    ratio = f"{total / minimum:.2f}x" if minimum else "n/a"
    print(
        f"\n  sent in all {fmt_bytes(total)}; analytic minimum {fmt_bytes(minimum)} ({parts or 'none'}); ratio {ratio}"
    )
    for row in r["instructions"] or []:
        print(
            f"  {row['name']:<28} {row['kind']:<20} {','.join(row['axes']) or '-':<14} x{row['count']:<5} "
            f"{fmt_bytes(row['bytes']):>12}  in {row['computation']}"
        )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from spmd.errors import UserError, report

    try:
        if args.host_devices is not None:
            _set_host_devices(args.host_devices)
        r = run(args)
    except UserError as e:
        report(e)
        return _exit_now(2)
    if args.json:
        print(json.dumps(r))
    else:
        print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
