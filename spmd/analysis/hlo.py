"""Collectives in optimised HLO text: kind, mesh axes, bytes, and how often each runs per step.

XLA's cost analysis counts a while-loop body once; here each instruction is weighted by the trip
counts of every loop around it (`known_trip_count` in the loop's backend config, or on the TPU
compiler's HLO, which has none, the bound its condition compares the counter with), so a collective
inside the scan over layers counts n_layers times.
"""

import collections
import dataclasses
import math
import re

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_COMP_START = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
# The computations an instruction calls, with the attribute that names each.
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]fn)?)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]  # mesh axes the devices of one group differ in
    bytes: int  # result bytes per device, one execution
    count: float  # executions per step (loop trip counts and conditional branches' shares multiplied in)
    computation: str  # the HLO computation it sits in
    loop_trips: int  # product of the enclosing loops' trip counts (1: not in a loop)
    name: str
    shapes: tuple[tuple[int, ...], ...] = ()  # each result array's dims (one per operand)
    op_name: str = ""  # the JAX operation it came from (HLO metadata), e.g. ".../while/body/.../dot_general"
    # An all-reduce of shards written into zeros (dynamic-update-slice): the TPU compiler's way of
    # gathering at scale. It sends what an all-reduce sends; what it does is a gather.
    as_gather: bool = False
    dtypes: tuple[str, ...] = ()  # each result array's element type, as HLO names it (f32, bf16, s8)


def shape_bytes(shape: str) -> int:
    return sum(
        _DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in _ARRAY.findall(shape)
    )


def _computations(text: str):
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        m = _COMP_START.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps, entry


_CONSTANT = re.compile(r"%([\w.\-]+) = [su]32\[\]\S* constant\((\d+)\)")


def _trips_from_condition(lines, body=()) -> int:
    """A loop's trip count from its condition where the backend config has none (the TPU
    compiler's HLO): `ROOT compare(counter, constant(N)), direction=LT`, the counter of a JAX scan
    or fori_loop starting at 0, runs N times (s32; the SPMD partitioner's windowed-einsum loops,
    which pass weight or activation blocks around a ring, count in u32). Where the body adds k > 1
    to the counter (a loop widened to k steps per iteration), ceil(N / k). Anything else counts once."""
    constants = dict(_CONSTANT.findall("\n".join(lines)))
    for line in lines:
        m = re.search(r"ROOT %\S+ = pred\[\]\S* compare\(%([\w.\-]+), %([\w.\-]+)\), direction=LT", line)
        if m and m.group(2) in constants:
            bound = int(constants[m.group(2)])
            index = re.search(
                rf"%{re.escape(m.group(1))} = \S+ get-tuple-element\(%[\w.\-]+\), index=(\d+)",
                "\n".join(lines),
            )
            step = _counter_step(body, int(index.group(1))) if index else 1
            return -(-bound // step)
    return 1


def _counter_step(body, index: int) -> int:
    """What the loop body adds to tuple element `index` (its counter): k from the ROOT tuple's
    operand `add(get-tuple-element(param, index), constant(k))`; 1 where it is not that."""
    text = "\n".join(body)
    root = next((x for x in body if x.strip().startswith("ROOT") and " tuple(" in x), None)
    if root is None:
        return 1
    operands = re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1].split(")", 1)[0])
    if index >= len(operands):
        return 1
    add = re.search(rf"%{re.escape(operands[index])} = \S+ add\(%([\w.\-]+), %([\w.\-]+)\)", text)
    if not add:
        return 1
    constants = dict(_CONSTANT.findall(text))
    counter = re.search(
        rf"%{re.escape(add.group(1))} = \S+ get-tuple-element\(%[\w.\-]+\), index={index}\b", text
    )
    if counter and add.group(2) in constants:
        return max(1, int(constants[add.group(2)]))
    return 1


def _holds_scope(comps, comp: str, tag: str) -> bool:
    """Whether `comp`, or a computation it calls, holds an instruction of the named scope `tag`."""
    todo, seen = [comp], {comp}
    while todo:
        for line in comps.get(todo.pop(), []):
            m = _INSTR.match(line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]*)"', m.group(4))
            if op and tag in op.group(1):
                return True
            for _, callee in _CALLED.findall(m.group(4)):
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    return False


def _multipliers(comps, entry, all_branches: bool = False, taken: dict[str, float] | None = None) -> dict:
    """How many times each computation runs per execution of the entry computation.
    `all_branches`: every branch of a conditional counted as if it ran (an upper bound: one does);
    else only the first is followed, except that a conditional whose branches hold scopes named
    in `taken` ({scope: share of the conditional's runs that take that branch}, which the program
    that made the conditional knows) counts each branch at its share (one branch without a scope
    at the rest)."""
    mult = collections.defaultdict(int)
    mult[entry] = 1
    order = [entry]
    seen = {entry}
    while order:
        comp = order.pop()
        for line in comps.get(comp, []):
            m = _INSTR.match(line)
            if not m:
                continue
            op, rest = m.group(3), m.group(4)
            trips = 1
            if op == "while":
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                cond = re.search(r"\bcondition=%([\w.\-]+)", rest)
                body = re.search(r"\bbody=%([\w.\-]+)", rest)
                trips = (
                    int(t.group(1))
                    if t
                    else _trips_from_condition(
                        comps.get(cond.group(1), []) if cond else [],
                        comps.get(body.group(1), []) if body else [],
                    )
                )
            called = [(attr, callee, 1) for attr, callee in _CALLED.findall(rest)]
            branches = re.search(r"\bbranch_computations=\{([^}]*)\}", rest)
            names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
            shares = _branch_shares(comps, names, taken) if names else None
            if shares:
                called = [(a, c, f) for a, c, f in called if a != "branch_computations"]
                called += [("branch_computations", b, share) for b, share in zip(names, shares, strict=True)]
            elif names and all_branches:
                called += [("branch_computations", b, 1) for b in names[1:]]
            for attr, callee, share in called:
                factor = trips if attr in ("body", "condition") else 1
                mult[callee] += mult[comp] * factor * share
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    return mult


def _branch_shares(comps, names, taken) -> list[float] | None:
    """Each branch's share of a conditional's runs, where every branch but at most one holds one
    scope of `taken` (that one takes what the others leave: an idle branch)."""
    if not taken:
        return None
    held = [[scope for scope in taken if _holds_scope(comps, b, f"/{scope}/")] for b in names]
    if any(len(h) > 1 for h in held) or sum(not h for h in held) > 1 or all(not h for h in held):
        return None
    shares = [taken[h[0]] if h else None for h in held]
    rest = 1 - sum(x for x in shares if x is not None)
    return [rest if x is None else x for x in shares]


def _iota_groups(spec: str) -> np.ndarray | None:
    m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if not m:
        return None
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(g, s)


def _groups(rest: str) -> list[list[int]] | None:
    m = re.search(r"replica_groups=(\{\{[\d,{} ]*\}\})", rest)
    if m:
        return [
            [int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(1)[1:-1])
        ]
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
    if m:
        return _iota_groups(m.group(1)).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:
        sizes = [(n.strip("' "), int(v)) for n, v in (kv.split("=") for kv in m.group(1).split(","))]
        along = [a.strip("' ") for a in m.group(2).split(",") if a.strip()]
        ids = np.arange(math.prod(s for _, s in sizes)).reshape([s for _, s in sizes])
        keep = [i for i, (n, _) in enumerate(sizes) if n in along]
        other = [i for i in range(len(sizes)) if i not in keep]
        return (
            ids.transpose(other + keep)
            .reshape(-1, math.prod(sizes[i][1] for i in keep) if keep else 1)
            .tolist()
        )
    return None


def _axes_of(groups, coords: dict[int, tuple[int, ...]], names) -> tuple[str, ...]:
    varying = set()
    for grp in groups:
        for dev in grp[1:]:
            varying |= {i for i, (a, b) in enumerate(zip(coords[grp[0]], coords[dev])) if a != b}
    return tuple(names[i] for i in sorted(varying))


_CHANNEL = re.compile(r"channel_id=(\d+)")


def _is_async_start(lines) -> bool:
    root = next((x for x in lines if x.strip().startswith("ROOT")), "")
    return 'custom_call_target="AsyncCollectiveStart"' in root


def _async_started(comps) -> tuple[set[str], set[tuple[str, str]]]:
    """(the start fusions, the (kind, channel id) of their collectives) of the TPU compiler's
    async collective fusions. It splits such a collective over a start fusion (whose root is an
    AsyncCollectiveStart custom call), one or more continuation fusions it overlaps with compute,
    and a done fusion, and writes the collective into each of them with the same channel id: it
    runs, and sends its bytes, once."""
    starts = {comp for comp, lines in comps.items() if _is_async_start(lines)}
    started = set()
    for comp in starts:
        for line in comps[comp]:
            m = _INSTR.match(line)
            channel = _CHANNEL.search(m.group(4)) if m else None
            if m and channel and m.group(3) in KINDS:
                started.add((m.group(3), channel.group(1)))
    return starts, started


def collectives(
    text: str, mesh, all_branches: bool = False, taken: dict[str, float] | None = None
) -> list[Collective]:
    """Every collective instruction of the optimised module, with its mesh axes and per-step count.
    `all_branches`: a conditional's branches counted as if each ran (e.g. a sync that runs every H
    steps), else only its first (what runs when nothing is due), except that a conditional whose
    branches hold scopes of `taken` counts each at its share (as `matmul_flops`; a count is then
    a mean, not always whole)."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry, all_branches, taken)
    names = tuple(mesh.axis_names)
    # Replica groups name devices by their place in the program's device assignment (the mesh's
    # devices in order), not by device id: the two differ for a permuted mesh or TPU slices.
    coords = {i: tuple(int(c) for c in idx) for i, (idx, _) in enumerate(np.ndenumerate(mesh.devices))}
    starts, started = _async_started(comps)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3)
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in KINDS or mult.get(comp, 0) == 0:
                continue
            channel = _CHANNEL.search(m.group(4))
            if comp not in starts and channel and (kind, channel.group(1)) in started:
                continue  # a copy of an async collective in its continuation or done fusion
            shape, rest = m.group(2), m.group(4)
            arrays = _ARRAY.findall(shape)
            # The TPU compiler's collective-permute-start also returns two u32[] context scalars.
            arrays = [a for a in arrays if a != ("u32", "")] if kind == "collective-permute" else arrays
            if op.endswith("-start") and len(arrays) > 1:  # (operands..., results...): count the results
                shape = " ".join(f"{dt}[{dims}]" for dt, dims in arrays[len(arrays) // 2 :])
            if kind == "collective-permute":
                pairs = [
                    [int(a), int(b)]
                    for a, b in re.findall(r"\{(\d+),(\d+)\}", rest.split("source_target_pairs=")[-1])
                ]
                groups = [p for p in pairs if p[0] != p[1]]
            else:
                groups = _groups(rest) or []
            axes = _axes_of(groups, coords, names) if groups else ()
            trips = mult[comp]
            if abs(trips - round(trips)) < 1e-9:  # branches' shares that add up to whole runs
                trips = round(trips)
            nbytes = shape_bytes(shape)
            if kind == "all-reduce" and comp.startswith("all-reduce-scatter") and groups:
                # The TPU compiler's reduce-scatter: a fusion of an all-reduce and the slice each
                # device keeps, run as one reduce-scatter; its result is that slice.
                kind, nbytes = "reduce-scatter", nbytes // len(groups[0])
            dims = tuple(tuple(int(d) for d in ds.split(",") if d) for _, ds in _ARRAY.findall(shape))
            if kind == "reduce-scatter" and comp.startswith("all-reduce-scatter"):
                root = next((_INSTR.match(x) for x in lines if x.strip().startswith("ROOT")), None)
                if root:  # the slice each device keeps
                    dims = tuple(
                        tuple(int(d) for d in ds.split(",") if d) for _, ds in _ARRAY.findall(root.group(2))
                    )
            op = re.search(r'op_name="([^"]*)"', rest)
            as_gather = kind == "all-reduce" and "dynamic-update-slice" in rest.split(")", 1)[0]
            out.append(
                Collective(
                    kind,
                    axes,
                    nbytes,
                    trips,
                    comp,
                    trips,
                    m.group(1),
                    dims,
                    op.group(1) if op else "",
                    as_gather,
                    tuple(dt for dt, _ in _ARRAY.findall(shape)),
                )
            )
    return out


def scope_runs(text: str, scope: str) -> int:
    """How many times per step the code of a JAX named scope runs: the trip counts of the loops
    that hold its instructions (through fusions and calls), not counting loops entered from inside
    the scope (its own inner loops) — once per run where it is in no loop."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry)
    tag = f"/{scope}/"
    parent, holding = {}, set()
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]*)"', m.group(4))
            inside = bool(op) and tag in op.group(1)
            if inside:
                holding.add(comp)
            for attr, callee in _CALLED.findall(m.group(4)):
                parent.setdefault(callee, (comp, attr == "body", inside))

    def enclosing_loop(comp):
        """(the loop body or entry that runs `comp`, whether that loop was entered from inside
        the scope)."""
        for _ in range(len(comps)):
            if comp == entry or comp not in parent:
                return comp, False
            caller, is_body, inside = parent[comp]
            if is_body:
                return comp, inside
            comp = caller
        return comp, False

    loops = {}
    for comp in holding:
        loop, from_inside = enclosing_loop(comp)
        if not from_inside:
            loops[loop] = mult.get(loop, 0)
    return sum(loops.values())


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One send between TPU slices (the TPU compiler's megascale transfers: what a collective over
    the data-center network becomes)."""

    bytes: int  # the payload, one execution
    count: int  # executions per step
    dtype: str
    shape: tuple[int, ...]
    op_name: str = ""


def slice_sends(text: str, all_branches: bool = False) -> list[Transfer]:
    """Every megascale send of the optimised module (what one device sends to other slices),
    with its per-step count; `all_branches` as in `collectives`."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry, all_branches)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(3) != "send" or "megascale" not in m.group(4) or not mult.get(comp):
                continue
            dtype, dims = _ARRAY.findall(m.group(2))[0]  # (payload, context u32[], token[])
            shape = tuple(int(d) for d in dims.split(",") if d)
            op = re.search(r'op_name="([^"]*)"', m.group(4))
            out.append(
                Transfer(shape_bytes(f"{dtype}[{dims}]"), mult[comp], dtype, shape, op.group(1) if op else "")
            )
    return out


def summarize(items: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """{(kind, axes): {"count": executions per step, "bytes": bytes per device per step}}."""
    table = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in items:
        row = table[(c.kind, c.axes)]
        row["count"] += c.count
        row["bytes"] += c.bytes * c.count
    return dict(table)


# Custom calls that run a Pallas kernel: Mosaic on TPU, Triton and Mosaic GPU on GPUs.
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu")


def kernel_calls(text: str) -> int:
    """Pallas kernel launches per step (custom calls of KERNEL_TARGETS, weighted by the trip counts
    of the loops around them; in a conditional, every branch's, an upper bound: a ring's blocks
    are computed or skipped by one)."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry, all_branches=True)
    targets = "|".join(re.escape(t) for t in KERNEL_TARGETS)
    pattern = re.compile(rf'custom_call_target="(?:{targets})"')
    return sum(
        mult.get(comp, 0)
        for comp, lines in comps.items()
        for line in lines
        if (m := _INSTR.match(line)) and m.group(3) == "custom-call" and pattern.search(line)
    )


def library_fusions(text: str, kind: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """The fused computations of an optimised module's library fusions of `kind` (XLA:CPU's
    backend_config kind, e.g. "__onednn_fusion"): {fusion instruction: [(name, opcode, result
    shape, operands and attributes) for each instruction of its computation, parameters too]}."""
    comps, _ = _computations(text)
    out = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            if m and m.group(3) == "fusion" and f'"kind":"{kind}"' in line:
                callee = re.search(r"calls=%([\w.\-]+)", line)
                body = [_INSTR.match(b) for b in comps.get(callee.group(1), [])] if callee else []
                out[m.group(1)] = [(b.group(1), b.group(3), b.group(2), b.group(4)) for b in body if b]
    return out


def matmul_flops(text: str, taken: dict[str, float] | None = None) -> float | None:
    """FLOPs of every dot in the optimised module per step (per device): 2 x result elements x
    contracted size, weighted by the trip counts of the loops around it. Counts what the program
    runs, idle pipeline stages and recomputation included, where model FLOPs count the math. A
    conditional counts its first branch, or, where a branch holds a scope of `taken` ({scope:
    share of the runs that take it}), each branch at its share. None for a module with
    convolutions (the TPU compiler's matmuls)."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry, taken=taken)
    total = 0.0
    for comp, lines in comps.items():
        if not mult.get(comp):
            continue
        shapes = {}
        for line in lines:
            m = _INSTR.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(3) not in ("dot", "convolution"):
                continue
            lhs = re.match(r"\s*%([\w.\-]+)", m.group(4))
            lhs_dims = _ARRAY.findall(shapes.get(lhs.group(1), "")) if lhs else []
            out_dims = _ARRAY.findall(m.group(2))
            if not (lhs_dims and out_dims):
                continue
            lhs_shape = [int(d) for d in lhs_dims[0][1].split(",") if d]
            if m.group(3) == "convolution":
                # The TPU compiler writes matmuls (batched ones with dilated, reversed and padded
                # windows) as convolutions, whose work this parser does not model: no figure.
                return None
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", m.group(4))
            if not contracting:
                continue
            k = math.prod(lhs_shape[int(i)] for i in contracting.group(1).split(",") if i)
            n_out = math.prod(int(d) for d in out_dims[0][1].split(",") if d)
            total += 2.0 * n_out * k * mult[comp]
    return total
