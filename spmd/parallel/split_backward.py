"""A backward pass split in two: the input's gradient now, the weights' gradient later.

A zero-bubble pipeline runs each stage's backward as two passes: B, the gradient of the stage's
input, which the previous stage waits for, and W, the gradient of its weights, which nobody waits
for and so can be deferred. Calling a pullback twice, once for each, would run the chain of
cotangents through the stage's layers twice (W needs the cotangent at every matmul's output, and
only that chain computes them). Instead `split` cuts the pullback's jaxpr: the first pass runs every
equation the input's gradient needs and returns, beside it, the values the rest reads (`saved`:
the cotangents at the weight-gradient matmuls, mostly); the second pass runs the rest from them.
Nothing is computed twice.

The layer scan is cut inside its body (the first scan returns, stacked per layer, what the second
scan's body reads), and so are remat regions and nested jits, to any depth; any other equation
that both passes need (a custom-VJP kernel, a shard_map) runs whole in the first pass and hands
its other outputs over.

What the first pass hands over waits, in a pipeline, for several microbatches, so the cut is
placed where that is small. W keeps the weight-gradient matmuls and what reads their results; the
cheap equations that only feed them (elementwise, layout and reductions) run in the first pass
when it has their inputs, so W reads each matmul's operands (a gated product, not its two
factors) and the finished gradient of a cheap weight (a norm's scale: one row per layer, not the
two activations it is summed from). A layout change (a reshape, a cast) of a value the first pass
computed is run again in the second when that saves no more than it does: one normalized input,
not one reshaped copy for each projection that reads it.
"""

import collections
import dataclasses
import itertools

import jax
from jax._src import source_info_util
from jax.extend import core as jax_core


@dataclasses.dataclass
class _ScanCut:
    """A scan whose body is cut: which carries each pass owns, and the body's plan."""

    body: "_Plan"
    consts: list[jax_core.Var]  # the body's invars, by role
    carries: list[jax_core.Var]
    xs: list[jax_core.Var]
    first_carries: list[int]
    second_carries: list[int]
    saved_keys: list  # outer keys of the per-iteration saved values, stacked by the first scan


@dataclasses.dataclass
class _CallCut:
    """A call (a remat region, a nested jit) whose body is cut: the body's plan."""

    body: "_Plan"
    saved_keys: list


@dataclasses.dataclass
class _Plan:
    jaxpr: jax_core.Jaxpr
    consts: list
    steps: list  # (pass, eqn, cut or None) in program order; pass "first" | "second" | "both" | "cut"
    outs_first: list[bool]
    outs_second: list[bool]
    saved: list  # the vars (or cut keys) the first pass defines and the second reads
    live_first: set
    live_second: set
    given_second: set  # the invars the second pass is given

    def live(self, which: str) -> set:
        """The vars a pass reads (which: "first" | "second")."""
        return self.live_first if which == "first" else self.live_second

    def outs(self, which: str) -> list[bool]:
        """Which outputs a pass gives."""
        return self.outs_first if which == "first" else self.outs_second


_keys = itertools.count()  # names of the values a cut's first pass hands its second


def _vars(atoms):
    return [a for a in atoms if isinstance(a, jax_core.Var) and not isinstance(a, jax_core.DropVar)]


def _is_scan(eqn) -> bool:
    return eqn.primitive.name == "scan" and "ft_in" in eqn.params


# Layout changes, which the second pass may rerun on a value it is handed (`_push`), and the cheap
# primitives the second pass hands to the first when they read only what the first has (`_pull`).
_LAYOUT = {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type", "copy"}  # fmt: skip
_CHEAP = _LAYOUT | {
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "log", "logistic",
    "tanh", "rsqrt", "sqrt", "integer_pow", "square", "select_n", "reduce_sum", "reduce_max",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
}  # fmt: skip

# Calls whose body runs inline where they are: remat regions (the backward's recomputation) and
# nested jits. Cutting them lets the weight gradients inside leave the first pass.
_CALLS = ("remat2", "jit")


def _call_body(eqn):
    body = eqn.params["jaxpr"]
    return (body.jaxpr, body.consts) if isinstance(body, jax_core.ClosedJaxpr) else (body, [])


def _scan_roles(eqn):
    consts, carries, xs = eqn.params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(list(consts)), len(list(carries)), len(list(xs))


def _plan(jaxpr, consts, need_first, need_second, later) -> _Plan:
    """Which equations each pass runs, for outputs `need_first` now and `need_second` later;
    `later[i]`: invar i is given to the second pass too (else it is saved if the second reads it)."""
    steps, live_first = _assign(jaxpr, need_first, need_second)
    available = set(v for v, given in zip(jaxpr.invars, later, strict=True) if not given)
    available |= live_first & set(jaxpr.invars)
    steps = _pull(steps, available | set(jaxpr.constvars))
    while True:
        plan = _finish(jaxpr, consts, steps, need_first, need_second, later)
        pushed = _push(plan)
        if not pushed:
            return plan
        steps = [(pushed.get(id(eqn), kind), eqn, cut) for kind, eqn, cut in steps]


def _assign(jaxpr, need_first, need_second):
    """Each equation to the pass that needs its outputs: (steps, the vars the first pass reads)."""
    live_first = set(_vars(v for v, n in zip(jaxpr.outvars, need_first, strict=True) if n))
    live_second = set(_vars(v for v, n in zip(jaxpr.outvars, need_second, strict=True) if n))
    steps = []
    for eqn in reversed(jaxpr.eqns):
        outs_f = [v in live_first for v in eqn.outvars]
        outs_s = [v in live_second and not f for v, f in zip(eqn.outvars, outs_f, strict=True)]
        if any(outs_f):
            cut = None
            if _is_scan(eqn) and any(outs_s):
                cut = _cut_scan(eqn, outs_f, outs_s)
            elif eqn.primitive.name in _CALLS and any(outs_s):
                cut = _cut_call(eqn, outs_f, outs_s)
            if cut is None:
                steps.append(("first", eqn, None))
                live_first.update(_vars(eqn.invars))
            else:
                steps.append(("cut", eqn, cut))
                live_first.update(_cut_invars(eqn, cut, "first"))
                live_second.update(_cut_invars(eqn, cut, "second"))
        elif any(outs_s):
            steps.append(("second", eqn, None))
            live_second.update(_vars(eqn.invars))
    steps.reverse()
    return steps, live_first


def _cheap(eqn) -> bool:
    """Elementwise, layout or a reduction, or a nested jit or custom-derivative call made only of
    those (the SwiGLU product): no matmul, no collective."""
    if eqn.primitive.name in _CHEAP:
        return True
    if eqn.primitive.name in ("jit", "custom_jvp_call", "custom_vjp_call"):
        body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        body = body.jaxpr if isinstance(body, jax_core.ClosedJaxpr) else body
        return all(_cheap(e) for e in body.eqns)
    return False


def _pull(steps, available):
    """Second-pass equations that are cheap and read only what the first pass has, run in the first
    pass instead: W then reads the weight matmuls' operands (one value each) and the finished
    gradients of the cheap weights (a norm's scale: a row of numbers, not two activations),
    rather than everything those were computed from."""
    out = []
    for kind, eqn, cut in steps:
        ins = _vars(eqn.invars)
        if kind == "second" and ins and _cheap(eqn) and all(v in available for v in ins):
            kind = "first"
        available.update(_defined_first(kind, eqn, cut))
        out.append((kind, eqn, cut))
    return out


def _defined_first(kind, eqn, cut) -> list:
    """What a step defines in the first pass: a first-pass equation's outputs, or a cut's
    first-pass outputs and the keys of what it saves."""
    if kind == "first":
        return _vars(eqn.outvars)
    if kind != "cut":
        return []
    if isinstance(cut, _CallCut):
        return _vars(o for o, f in zip(eqn.outvars, cut.body.outs_first, strict=True) if f) + cut.saved_keys
    n_c, n_k, _ = _scan_roles(eqn)
    ys = _vars(o for o, f in zip(eqn.outvars[n_k:], cut.body.outs_first[n_k:], strict=True) if f)
    return [eqn.outvars[i] for i in cut.first_carries] + ys + cut.saved_keys


def _bytes(v) -> int:
    return v.aval.size * v.aval.dtype.itemsize


def _push(plan):
    """{id(equation): its new pass} for saved values that a layout change made from another value:
    the second pass reruns the change when its input is smaller, saved or given anyway, or read
    by more than one such change (three projections' reshapes of one normalized input save it
    once); a change that would only move work into W stays where it is."""
    held = set(plan.saved) | plan.given_second | set(plan.jaxpr.constvars)
    changes = [
        eqn
        for kind, eqn, _ in plan.steps
        if kind == "first"
        and eqn.primitive.name in _LAYOUT
        and len(_vars(eqn.invars)) == 1
        and any(v in plan.saved for v in eqn.outvars)
    ]
    readers = collections.Counter(_vars(eqn.invars)[0] for eqn in changes)
    pushed = {}
    for eqn in changes:
        (x,) = _vars(eqn.invars)
        if x in held or readers[x] > 1 or _bytes(x) < sum(_bytes(v) for v in eqn.outvars):
            pushed[id(eqn)] = "both" if any(v in plan.live_first for v in eqn.outvars) else "second"
    return pushed


def _finish(jaxpr, consts, steps, need_first, need_second, later) -> _Plan:
    """The plan of `steps`: what each pass reads, and what the first hands the second."""
    live_first = set(_vars(v for v, n in zip(jaxpr.outvars, need_first, strict=True) if n))
    live_second = set(_vars(v for v, n in zip(jaxpr.outvars, need_second, strict=True) if n))
    for kind, eqn, cut in reversed(steps):
        if kind in ("first", "both"):
            live_first.update(_vars(eqn.invars))
        if kind in ("second", "both"):
            live_second.update(_vars(eqn.invars))
        if kind == "cut":
            live_first.update(_cut_invars(eqn, cut, "first"))
            live_second.update(_cut_invars(eqn, cut, "second"))
    defined_first = [v for v, given in zip(jaxpr.invars, later, strict=True) if not given]
    for kind, eqn, cut in steps:
        defined_first += _defined_first(kind, eqn, cut)
    saved = [v for v in dict.fromkeys(defined_first) if v in live_second]
    given = set(v for v, g in zip(jaxpr.invars, later, strict=True) if g)
    return _Plan(
        jaxpr, consts, steps, list(need_first), list(need_second), saved, live_first, live_second, given
    )


def _cut_invars(eqn, cut, which):
    if isinstance(cut, _CallCut):
        live = cut.body.live(which)
        picked = _vars(o for o, b in zip(eqn.invars, cut.body.jaxpr.invars, strict=True) if b in live)
        return picked + (cut.saved_keys if which == "second" else [])
    n_c, n_k, _ = _scan_roles(eqn)
    consts, carries, xs = eqn.invars[:n_c], eqn.invars[n_c : n_c + n_k], eqn.invars[n_c + n_k :]
    live = cut.body.live(which)
    own = cut.first_carries if which == "first" else cut.second_carries
    picked = [o for o, b in zip(consts, cut.consts, strict=True) if b in live]
    picked += [carries[i] for i in own]
    picked += [o for o, b in zip(xs, cut.xs, strict=True) if b in live]
    return _vars(picked) + (cut.saved_keys if which == "second" else [])


def _cut_call(eqn, outs_f, outs_s):
    jaxpr, consts = _call_body(eqn)
    plan = _plan(jaxpr, consts, outs_f, outs_s, [True] * len(jaxpr.invars))
    return _CallCut(plan, [("saved", next(_keys)) for _ in plan.saved])


def _cut_scan(eqn, outs_f, outs_s):
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    n_c, n_k, _ = _scan_roles(eqn)
    b_consts, b_carries, b_xs = body.invars[:n_c], body.invars[n_c : n_c + n_k], body.invars[n_c + n_k :]
    first = {i for i in range(n_k) if outs_f[i]}
    second = {i for i in range(n_k) if outs_s[i]} - first
    while True:
        need_f = [i in first for i in range(n_k)] + outs_f[n_k:]
        need_s = [i in second for i in range(n_k)] + [
            s and not f for s, f in zip(outs_s[n_k:], outs_f[n_k:], strict=True)
        ]
        later = [True] * n_c + [i not in first for i in range(n_k)] + [True] * len(b_xs)
        plan = _plan(body, closed.consts, need_f, need_s, later)
        grown_f = {i for i, v in enumerate(b_carries) if v in plan.live_first} - first
        grown_s = {i for i, v in enumerate(b_carries) if v in plan.live_second} - first - second - grown_f
        if not grown_f and not grown_s:
            break
        first |= grown_f
        second = (second | grown_s) - first
    if not any(need_s) and not plan.saved:
        return None
    keys = [("saved", next(_keys)) for _ in plan.saved]
    return _ScanCut(plan, b_consts, b_carries, b_xs, sorted(first), sorted(second), keys)


def _bind(eqn, invals):
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def _read(env, v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]


def _run(plan: _Plan, env: dict, which: str):
    """Run one pass's equations over `env` (filled with what that pass is given)."""
    for v, c in zip(plan.jaxpr.constvars, plan.consts, strict=True):
        env[v] = c
    for kind, eqn, cut in plan.steps:
        if kind == which or kind == "both":
            out = _bind(eqn, [_read(env, v) for v in eqn.invars])
            env.update(zip(eqn.outvars, out, strict=True))
        elif kind == "cut" and isinstance(cut, _CallCut):
            inner = {b: _read(env, o) for o, b in zip(eqn.invars, cut.body.jaxpr.invars, strict=True)
                     if b in cut.body.live(which)}  # fmt: skip
            if which == "second":
                inner.update(zip(cut.body.saved, [env[k] for k in cut.saved_keys], strict=True))
            _run(cut.body, inner, which)
            wanted = cut.body.outs(which)
            env.update(
                (o, _read(inner, b))
                for o, b, w in zip(eqn.outvars, cut.body.jaxpr.outvars, wanted, strict=True)
                if w
            )
            if which == "first":
                env.update(zip(cut.saved_keys, [_read(inner, v) for v in cut.body.saved], strict=True))
        elif kind == "cut":
            _run_cut(eqn, cut, env, which)


def _run_cut(eqn, cut: _ScanCut, env, which):
    n_c, n_k, _ = _scan_roles(eqn)
    o_consts, o_carries, o_xs = eqn.invars[:n_c], eqn.invars[n_c : n_c + n_k], eqn.invars[n_c + n_k :]
    body = cut.body
    live = body.live(which)
    own = cut.first_carries if which == "first" else cut.second_carries
    const_pairs = [(b, _read(env, o)) for o, b in zip(o_consts, cut.consts, strict=True) if b in live]
    x_pairs = [(b, o) for o, b in zip(o_xs, cut.xs, strict=True) if b in live]
    xs = [_read(env, o) for _, o in x_pairs]
    if which == "second":
        xs += [env[k] for k in cut.saved_keys]
    n_x = len(x_pairs)
    outs = body.jaxpr.outvars
    ys_wanted = [i for i in range(n_k, len(outs)) if body.outs(which)[i]]

    def step(carry, x):
        inner = dict((b, v) for b, v in const_pairs)
        inner.update(zip([cut.carries[i] for i in own], carry, strict=True))
        inner.update(zip([b for b, _ in x_pairs], x[:n_x], strict=True))
        if which == "second":
            inner.update(zip(body.saved, x[n_x:], strict=True))
        _run(body, inner, which)
        ys = [_read(inner, outs[i]) for i in ys_wanted]
        if which == "first":
            ys += [_read(inner, v) for v in body.saved]
        return [_read(inner, outs[i]) for i in own], ys

    init = [_read(env, o_carries[i]) for i in own]
    carry, ys = jax.lax.scan(
        step,
        init,
        xs,
        length=eqn.params["length"],
        reverse=eqn.params["reverse"],
        unroll=eqn.params["unroll"],
    )
    env.update(zip([eqn.outvars[i] for i in own], carry, strict=True))
    env.update(zip([eqn.outvars[i] for i in ys_wanted], ys[: len(ys_wanted)], strict=True))
    if which == "first":
        env.update(zip(cut.saved_keys, ys[len(ys_wanted) :], strict=True))


@dataclasses.dataclass
class Split:
    """`first(*args) -> (outputs now, saved)`; `second(*given, saved) -> outputs later`, where
    `given` are the args marked `later`."""

    plan: _Plan
    later: list[bool]

    def first(self, *args):
        env = dict(zip(self.plan.jaxpr.invars, args, strict=True))
        _run(self.plan, env, "first")
        outs = [
            _read(env, v) for v, n in zip(self.plan.jaxpr.outvars, self.plan.outs_first, strict=True) if n
        ]
        return outs, [env[v] for v in self.plan.saved]

    def second(self, given, saved):
        invars = [v for v, g in zip(self.plan.jaxpr.invars, self.later, strict=True) if g]
        env = dict(zip(invars, given, strict=True))
        env.update(zip(self.plan.saved, saved, strict=True))
        _run(self.plan, env, "second")
        return [
            _read(env, v) for v, n in zip(self.plan.jaxpr.outvars, self.plan.outs_second, strict=True) if n
        ]


def split(closed: jax_core.ClosedJaxpr, n_first: int, later: list[bool]) -> Split:
    """Cut `closed` (outputs: the first `n_first` now, the rest later); `later[i]`: input i is
    given to the second pass as well."""
    n = len(closed.jaxpr.outvars)
    need_first = [i < n_first for i in range(n)]
    plan = _plan(closed.jaxpr, closed.consts, need_first, [not f for f in need_first], later)
    return Split(plan, list(later))
