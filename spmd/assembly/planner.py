"""Choose a mesh and rules preset for a model on N devices within a memory budget (`spmd-plan`).

    spmd-plan --config llama-70b --devices 256 --memory-per-device 80GiB [--dcn 4] [--hardware h100]

1. Enumerate meshes (factorisations of N over data, fsdp and tensor; expert too for MoE models;
   any of the six axes with --axes, e.g. `--axes data,fsdp,tensor,stage` for pipelines) with the
   presets whose axes cover them, as the preset files say (`preset_axes`; every preset but those
   that say `plan = false`), one per distinct layout (`layout`: fsdp_tp on a mesh without tensor
   is fsdp); reject those the rules cannot shard (divisibility) or the pipeline cannot schedule
   ([pipeline] of the config).
2. Prune by analytic memory: parameters + gradients + optimizer state per device must fit (with
   the optimizer state offloaded to host memory, `optimizer.offload`, where the devices have it
   and nothing else fits).
3. Rank the rest by a roofline step time: model FLOPs / peak + analytic collective bytes / link
   bandwidth (axes that span hosts, with --dcn, use the DCN bandwidth), compute and communication
   not overlapped (a conservative bound); a pipeline's compute is stretched by its bubble.
4. Dry-run (compile, nothing allocated) down the ranking until --candidates layouts fit (at most
   --max-compiles). A layout whose compiled peak (spmd.analysis.aot.peak_bytes) exceeds the budget tries the
   memory levers (`LEVERS`: model.remat and train.microbatches), the cheapest first that its own
   measured activations say will fit, compiled again to check (at most MAX_TRIES per layout).
   Re-rank with the collective bytes the compiled step really sends and the recomputation its
   remat policy costs, and print the top five with the levers each took and why.
"""

import dataclasses
import math
import re

from spmd.analysis.hardware import CHIPS
from spmd.core.errors import UserError
from spmd.core.mesh import MESH_AXES, format_mesh, split_over_hosts

# Memory levers, for a layout whose compiled step does not fit. Remat policies from the most
# memory to the least, with the compute each costs (full remat runs the forward twice: 8 of the
# 6 FLOPs per parameter and token) and the share of the activations each keeps, relative to no
# remat: a first guess to pick what to compile next; the compile decides.
REMAT_LEVER = {"none": (1.0, 1.0), "save_dots": (1.0, 0.55), "full": (4 / 3, 0.2)}
MICROBATCHES = (1, 2, 4, 8, 16, 32)  # gradient accumulation: activations of 1/M of the batch at a time
MAX_TRIES = 3  # compiles per layout: as given, then at most two lever settings
MARGIN = 0.9  # a lever is tried when its predicted peak is under this share of the budget
# Host link for the offloaded optimizer state (to the device and back each step), when the chip
# table says nothing of it: PCIe 4.0 x16, a conservative figure (--host-gbps overrides).
HOST_BYTES_PER_S = 25e9

# Logical names that carry the batch: a preset maps them over every data-parallel axis it may get.
BATCH_NAMES = ("batch", "act_moe_batch")


def preset_axes(rules) -> set[str]:
    """The mesh axes a preset is written for: `data` (where its batch goes) and every axis it maps
    anything but the batch to."""
    return {"data"} | {a for name, axes in rules.mapping.items() if name not in BATCH_NAMES for a in axes}


def layout(rules, sizes: dict) -> tuple:
    """What `rules` do on a mesh of these sizes: the mapping without its axes of size 1, the sharded
    weight update's axes, and the context-parallel mode where the sequence is split."""
    mapping = tuple(
        sorted((n, tuple(a for a in axes if sizes.get(a, 1) > 1)) for n, axes in rules.mapping.items())
    )
    zero = tuple(a for a in rules.shard_optimizer_over if sizes.get(a, 1) > 1)
    split_seq = any(sizes.get(a, 1) > 1 for a in rules.mapping.get("seq", ()))
    return mapping, zero, rules.context_parallel if split_seq else ""


def _simplicity(rules) -> tuple:
    return sum(len(axes) for axes in rules.mapping.values()), rules.name


def candidate_presets(sizes: dict, rules_by_name: dict) -> list[str]:
    """The presets to try on a mesh of these sizes: those written for its axes, and of those that
    do the same there, the simplest (fewest mapped axes)."""
    used = {a for a, s in sizes.items() if s > 1}
    by_layout: dict = {}
    for rules in sorted(rules_by_name.values(), key=_simplicity):
        if rules.plan and used <= preset_axes(rules):
            by_layout.setdefault(layout(rules, sizes), rules.name)
    return list(by_layout.values())


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B?|B)?\s*", text, re.I)
    if not m:
        from spmd.core.errors import UserError

        raise UserError(f"--memory-per-device must look like 80GiB or 512MiB, got {text!r}")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " ")) if unit else int(float(m.group(1)))


def hardware(name: str, peak_tflops: float | None = None, ici_gbps: float | None = None,
             dcn_gbps: float | None = None) -> dict:  # fmt: skip
    """{peak, ici, dcn} of a chip in spmd.analysis.hardware.CHIPS, with any of them overridden."""
    chip = CHIPS[name]
    hw = {"peak": chip.peak_flops, "ici": chip.ici_bytes_per_s, "dcn": chip.dcn_bytes_per_s}
    for key, value, scale in (("peak", peak_tflops, 1e12), ("ici", ici_gbps, 1e9), ("dcn", dcn_gbps, 1e9)):
        if value is not None:
            if not (value > 0 and value != float("inf")):
                from spmd.core.errors import UserError

                flag = {"peak": "--peak-tflops", "ici": "--ici-gbps", "dcn": "--dcn-gbps"}[key]
                raise UserError(f"{flag} must be a positive number, got {value}")
            hw[key] = value * scale
    return hw


def meshes(n: int, axes=("data", "fsdp", "tensor")):
    """Every way to write n as a product of sizes over `axes` (in that order)."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in (d for d in range(1, n + 1) if n % d == 0):
        for rest in meshes(n // d, axes[1:]):
            yield {axes[0]: d, **rest}


def search_axes(cfg, text: str | None) -> tuple[str, ...]:
    from spmd.core.errors import UserError

    if text is None:
        experts = cfg.model_family.figures(cfg.model, cfg.train.seq_len).n_experts
        wanted = {"data", "fsdp", "tensor"} | ({"expert"} if experts else set())
    else:
        wanted = {a.strip() for a in text.split(",") if a.strip()}
        unknown = sorted(wanted - set(MESH_AXES))
        if unknown or not wanted:
            raise UserError(
                f"--axes: unknown mesh axis {', '.join(unknown) or '(none given)'}; "
                f"choose among {', '.join(MESH_AXES)}"
            )
    return tuple(a for a in MESH_AXES if a in wanted)


def enumerate_candidates(cfg, n: int, axes=("data", "fsdp", "tensor"), devices=None):
    """(mesh spec, preset, Setup or None, reason if rejected) for every mesh and the presets to try
    on it (candidate_presets), over `devices` (default: JAX's)."""
    from spmd.assembly.setup import assemble
    from spmd.core.rules import load_rules, presets

    rules = {preset: load_rules(preset) for preset in presets()}  # parsed once, not once per mesh
    for sizes in meshes(n, axes):
        spec = format_mesh(sizes, empty="data=1")
        for preset in candidate_presets(sizes, rules):
            try:
                yield spec, preset, assemble(cfg, spec, rules[preset], devices=devices), None
            except UserError as e:
                yield spec, preset, None, str(e)


@dataclasses.dataclass
class Search:
    """What `search` found: layouts that fit, fastest first (each dry-run compiled), and why the
    others were rejected."""

    # mesh, rules, setup, levers (config overrides taken), why, static, need, sent, compile_s,
    # compute_s, comm_s, step_s, dcn_axes, notes
    ranked: list[dict]
    rejected: list[tuple[str, str, str]]  # (mesh, rules, reason)
    fit_by_analytic_memory: int
    compiled: int


def _levers(
    cfg, tried: dict, measured_need: int, state: int, budget: int
) -> list[tuple[float, list[str], float]]:
    """(relative step cost, overrides, predicted peak) of each lever setting predicted to fit, cheapest first,
    from one compiled setting (`tried`: its remat and microbatches) that needed `measured_need`
    bytes of which `state` are the train state (arguments and outputs; the rest activations)."""
    acts = max(0, measured_need - state)
    base_keep = REMAT_LEVER[tried["remat"]][1]
    out = []
    for remat, (compute, keep) in REMAT_LEVER.items():
        if keep > base_keep:  # keeps more than what did not fit
            continue
        for m in MICROBATCHES:
            if m < tried["microbatches"] or cfg.train.global_batch_size % m:
                continue
            predicted = state + acts * keep / base_keep * tried["microbatches"] / m
            if predicted > MARGIN * budget or (remat, m) == (tried["remat"], tried["microbatches"]):
                continue
            # More microbatches: each gathers the FSDP weights again; a small cost per doubling.
            out.append(
                (
                    compute * (1 + 0.02 * (m.bit_length() - 1)),
                    [f"model.remat={remat}", f"train.microbatches={m}"],
                    predicted,
                )
            )
    out.sort(key=lambda c: c[0])
    return out


def _changed(cfg, setting: list[str]) -> list[str]:
    """The overrides of a lever setting that differ from the config: only those are levers."""
    given = {"model.remat": cfg.model.remat, "train.microbatches": str(cfg.train.microbatches)}
    return [lv for lv in setting if given[lv.split("=")[0]] != lv.split("=")[1]]


def search(cfg, devices: int, budget: int, hw: dict, dcn: int = 1, axes=None, candidates: int = 6,
           max_compiles: int | None = None, device_list=None, host_bytes_per_s: float = HOST_BYTES_PER_S,
           analytic_comm: bool = False) -> Search:  # fmt: skip
    """Steps 1-4 of the module doc for `cfg` on `devices` devices with `budget` bytes each
    (`device_list`: compile for these, e.g. a TPU topology's, instead of JAX's own).
    `analytic_comm`: rank compiled layouts by the analytic bytes of their collectives (what NCCL
    runs on GPUs: reduce-scatter and all-gather), not by the compiled step's, when the compiler is
    not the target's (XLA:CPU all-reduces what GPUs reduce-scatter)."""
    from spmd.analysis.aot import DoesNotFit, dry_run, estimate, volume_by_axis
    from spmd.assembly.config import apply_overrides
    from spmd.assembly.setup import assemble
    from spmd.parallel import memory
    from spmd.parallel.sharding import fmt_bytes

    max_compiles = max_compiles if max_compiles is not None else 4 * candidates
    if min(devices, dcn, candidates, max_compiles) < 1:
        raise UserError("--devices, --dcn, --candidates and --max-compiles must be positive")
    if devices % dcn:
        raise UserError(f"--devices {devices} must divide by --dcn {dcn}")
    fits, rejected = [], []
    candidates_ = enumerate_candidates(cfg, devices, axes or search_axes(cfg, None), device_list)
    for spec, preset, setup, reason in candidates_:
        if setup is None:
            rejected.append((spec, preset, reason))
            continue
        held = setup.trainer.state_bytes()
        static = held["params"] + held["gradients"] + held["optimizer_state"]
        levers, why = [], ""
        if static > budget and not cfg.optimizer.offload and memory.host_memory_kinds(setup.mesh):
            # The optimizer state in host memory between steps: only what the update needs moves.
            levers = ["optimizer.offload=true"]
            why = f"params + grads + optimizer state {fmt_bytes(static)} > budget: optimizer state kept in host memory"
            static -= held["optimizer_state"]
        if static > budget:
            why = f"params + grads + optimizer state {fmt_bytes(static)} per device > budget {fmt_bytes(budget)}"
            rejected.append((spec, preset, why))
            continue
        if levers:
            setup = assemble(apply_overrides(cfg, levers), spec, setup.rules, devices=device_list)
        est = estimate(setup.cfg, setup.plan, hw, dcn)
        if levers:  # the state to the device and back each step
            est["comm_s"] += 2 * held["optimizer_state"] / host_bytes_per_s
            est["step_s"] = est["compute_s"] + est["comm_s"]
        fits.append({"mesh": spec, "rules": preset, "setup": setup, "static": static, "levers": levers,
                     "why": why, **est})  # fmt: skip
        for more, reason in schedule_offers(setup):
            try:
                variant = assemble(
                    apply_overrides(cfg, [*levers, *more]), spec, setup.rules, devices=device_list
                )
            except UserError as e:
                rejected.append((spec, preset + sets([*levers, *more]), str(e)))
                continue
            fits.append({"mesh": spec, "rules": preset, "setup": variant, "static": static,
                         "levers": [*levers, *more], "why": (why + "; " if why else "") + reason,
                         **estimate(variant.cfg, variant.plan, hw, dcn)})  # fmt: skip
    fits.sort(key=lambda c: c["step_s"])

    # The analytic memory above leaves activations out, so at long sequences the fastest layouts
    # only fail once compiled: those try the memory levers, and the search goes down the ranking
    # until enough fit.
    ranked, compiled = [], 0
    for cand in fits:
        tried = {"remat": cand["setup"].cfg.model.remat, "microbatches": cand["setup"].cfg.train.microbatches}
        setup, levers, why = cand["setup"], list(cand["levers"]), cand["why"]
        for attempt in range(MAX_TRIES):
            if len(ranked) == candidates or compiled == max_compiles:
                break
            compiled += 1
            try:
                r = dry_run(setup)
            except DoesNotFit as e:  # the TPU compiler's refusal (spmd-plan --topology)
                rejected.append((cand["mesh"], cand["rules"] + sets(levers), str(e)))
                break
            need = r["per_device_bytes"]["peak"]
            if need <= budget:
                est = estimate(
                    setup.cfg,
                    setup.plan,
                    hw,
                    dcn,
                    None if analytic_comm else volume_by_axis(r["collectives"]),
                )
                recompute = REMAT_LEVER.get(setup.cfg.model.remat, (1.0, 1.0))[0]
                est["compute_s"] *= recompute
                if "optimizer.offload=true" in levers:
                    est["comm_s"] += 2 * setup.trainer.state_bytes()["optimizer_state"] / host_bytes_per_s
                est["step_s"] = est["compute_s"] + est["comm_s"]
                ranked.append({**cand, **est, "setup": setup, "levers": levers, "why": why, "need": need,
                               "sent": est["sent_bytes"] if analytic_comm else r["collective_volume_bytes"],
                               "compile_s": r["compile_seconds"],
                               "notes": r["notes"]})  # fmt: skip
                break
            state = (
                r["per_device_bytes"]["arguments"]
                + r["per_device_bytes"]["outputs"]
                - r["per_device_bytes"]["aliased"]
            )
            over = f"compiled step needs {fmt_bytes(need)} per device (peak: arguments + outputs - aliased + temporaries) > budget {fmt_bytes(budget)}"
            options = _levers(setup.cfg, tried, need, state, budget) if attempt + 1 < MAX_TRIES else []
            if not options:
                rejected.append((cand["mesh"], cand["rules"] + sets(levers), over))
                break
            setting = options[0][1]
            tried = {"remat": setting[0].split("=")[1], "microbatches": int(setting[1].split("=")[1])}
            changed = _changed(cfg, setting)
            step = f"with {', '.join(levers)}" if levers else "as given"
            taken = f"{step} the compiled step needed {fmt_bytes(need)}, so {', '.join(changed)}"
            why = (why + "; " if why else "") + taken + " (the cheapest setting its activations say will fit)"
            levers = [
                lv for lv in levers if lv.split("=")[0] not in {c.split("=")[0] for c in setting}
            ] + changed
            try:
                setup = assemble(apply_overrides(cfg, levers), cand["mesh"], setup.rules, devices=device_list)
            except UserError as e:
                rejected.append((cand["mesh"], cand["rules"] + sets(levers), str(e)))
                break
    ranked.sort(key=lambda c: c["step_s"])
    return Search(ranked, rejected, len(fits), compiled)


def schedule_offers(setup) -> list[tuple[list[str], str]]:
    """For a layout with a GPipe or circular pipeline: 1F1B and ZB-H1 (interleaved 1F1B and
    interleaved zero-bubble where it repeats) with as many microbatches as the batch allows up to 8
    per stage, (overrides, why); they hold at most 2 R S - 1 microbatch chunks' activations whatever
    M, so a larger M costs no memory and shrinks the bubble. Empty without a pipeline or where the
    schedule is one of those already."""
    from spmd.parallel.pipeline import SCHEDULED

    schedule, cfg = setup.plan.schedule, setup.cfg
    if schedule is None or schedule.name in SCHEDULED:
        return []
    S, R = schedule.stages, schedule.repeats
    rows = cfg.train.global_batch_size // cfg.train.microbatches
    sizes = dict(setup.plan.mesh.shape)
    dp = math.prod(sizes[a] for a in setup.plan.rules.mapping.get("batch", ()) if a not in schedule.axes)
    fits = [
        m
        for m in (2 * S, 4 * S, 8 * S)
        if m > schedule.microbatches and rows % m == 0 and (rows // m) % dp == 0
    ]
    if not fits:
        return []
    best = max(fits)
    one = dataclasses.replace(schedule, microbatches=best, kind="interleaved_1f1b" if R > 1 else "1f1b")
    gpipe = f"GPipe at M = {schedule.microbatches}: {schedule.bubble_fraction:.1%}"
    offers = [([f"pipeline.schedule={one.name}", f"pipeline.microbatches={best}"],
               f"{one.name} holds at most {one.in_flight} microbatch chunks per stage whatever M, so "
               f"M = {best}: bubble {one.bubble_fraction:.1%} ({gpipe})")]  # fmt: skip
    zb = dataclasses.replace(one, kind="interleaved_zb" if R > 1 else "zb_h1")
    if R > 1:
        why = (f"interleaved_zb runs one pass of a chunk per stage and tick (forward, input or weight gradient), "
               f"idling a third of what interleaved_1f1b does, and holds at most {zb.in_flight} microbatch chunks "
               f"per stage whatever M")  # fmt: skip
    else:
        why = (f"zb_h1 runs one pass per stage and tick (forward, input or weight gradient), idling a third of "
               f"what 1f1b does, and holds at most {zb.in_flight} microbatches per stage whatever M")  # fmt: skip
    offers.append(([f"pipeline.schedule={zb.name}", f"pipeline.microbatches={best}"],
                   f"{why}, so M = {best}: bubble {zb.bubble_fraction:.1%} ({one.name}'s "
                   f"{one.bubble_fraction:.1%}; {gpipe})"))  # fmt: skip
    if R == 1 and best % S == 0 and setup.plan.layer_groups % (2 * S) == 0:
        # Two chunks per stage: half zb_h1's idle time, W's inputs half-size.
        izb = dataclasses.replace(zb, kind="interleaved_zb", repeats=2)
        offers.append((["pipeline.schedule=interleaved_zb", "pipeline.repeats=2", f"pipeline.microbatches={best}"],
                       f"interleaved_zb with 2 layer groups per stage idles half what zb_h1 does, holding W's "
                       f"inputs half-size, at most {izb.in_flight} microbatch chunks per stage whatever M, so "
                       f"M = {best}: bubble {izb.bubble_fraction:.1%} (zb_h1's {zb.bubble_fraction:.1%}, 1f1b's "
                       f"{one.bubble_fraction:.1%}), at twice the moves between stages"))  # fmt: skip
    return offers


# What spmd-plan offers when the gradients' all-reduce across hosts outlasts the step's compute:
# the [sync] settings (docs/slices.md) and what each costs besides bytes.
SYNC_OFFERS = (
    (["sync.compress=int8"], "each gradient rounded to int8 per row; error feedback carries the rounding to the next step"),
    (["sync.compress=powersgd", "sync.rank=4"], "each matrix's gradient as rank-4 factors (error feedback); slower per token"),
    (["sync.method=diloco", "sync.inner_steps=32"], "the slices train apart for 32 steps and hold two more parameter copies; slower per token"),
)  # fmt: skip


def sync_offers(cfg, cand: dict, hw: dict, hosts: int) -> tuple[float, list[tuple[list[str], float, str]]]:
    """(seconds the plain gradient all-reduce across hosts takes over DCN per step, [(settings,
    bytes each device would send across hosts per step instead, price)]) for a ranked layout
    whose data axis spans hosts and whose all-reduce there outlasts its compute; else (0, [])."""
    from spmd.assembly.config import apply_overrides
    from spmd.core.mesh import split_over_hosts
    from spmd.parallel import slices

    plan = cand["setup"].plan
    n = split_over_hosts(dict(plan.mesh.shape), hosts)[0].get("data", 1)
    if n <= 1 or any("data" in slices.spec_axes(e) for p in plan.params for e in p.spec):
        return 0.0, []
    dcn_s = slices.analytic_sent(cfg, plan, n)["allreduce"] / hw["dcn"]
    if dcn_s <= cand["compute_s"]:
        return dcn_s, []
    offers = []
    for setting, price in SYNC_OFFERS:
        c = apply_overrides(cfg, setting)
        views = slices.matrix_views(plan, lambda t: t, c.sync.rank) if c.sync.compress == "powersgd" else None
        offers.append((setting, slices.analytic_sent(c, plan, n, views)["sync"], price))
    return dcn_s, offers


def sets(levers: list[str]) -> str:
    """The levers as the flags that set them: ' --set model.remat=full ...'."""
    return "".join(f" --set {lv}" for lv in levers)


def command(config: str, mesh: str, rules: str, overrides: list[str], hosts: int = 1) -> str:
    """The spmd-train command line that runs a planned layout: across several hosts, `--dcn-mesh`
    for the axes that span them and `--mesh` for one host's share (docs/multihost.md)."""
    from spmd.core.mesh import parse_mesh

    sizes = {a: s for a, s in parse_mesh(mesh).items() if s > 1} or {"data": 1}
    across, inside, left = split_over_hosts(sizes, hosts)
    if hosts == 1 or left > 1:  # one host, or hosts that do not divide out of the axes: one --mesh
        where = f"--mesh {format_mesh(sizes, empty='data=1')}"
    else:
        where = f"--dcn-mesh {format_mesh(across)} --mesh {format_mesh(inside, empty='data=1')}"
    return f"spmd-train --config {config} {where} --rules {rules}" + "".join(f" --set {o}" for o in overrides)


def verdict(cfg, report: dict, budget: int) -> dict:
    """Whether a dry-run's compiled step fits `budget` bytes per device: {fits, need, budget, over,
    levers}; over budget, `levers` are the config overrides the planner would take (the cheapest
    remat x microbatches setting its measured activations say will fit) or, where the train state
    alone does not fit, what it would need instead."""
    per = report["per_device_bytes"]
    need = per["peak"]
    out = {
        "fits": need <= budget,
        "need": need,
        "budget": budget,
        "over": max(0, need - budget),
        "levers": [],
    }
    if out["fits"]:
        return out
    static = per["params"] + per["gradients"] + per["optimizer_state"]
    if static > budget:
        out["levers"] = [
            "more devices on the fsdp axis (params + gradients + optimizer state alone are over)"
        ]
        if not cfg.optimizer.offload:
            out["levers"].append("optimizer.offload=true (the optimizer state in host memory)")
        return out
    state = per["arguments"] + per["outputs"] - per["aliased"]
    tried = {"remat": cfg.model.remat, "microbatches": cfg.train.microbatches}
    options = _levers(cfg, tried, need, state, budget)
    if options:
        out["levers"] = _changed(cfg, options[0][1])
        out["predicted"] = options[0][2]
    else:
        out["levers"] = ["more devices (no remat x microbatches setting is predicted to fit)"]
    return out
