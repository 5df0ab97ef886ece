"""Parallelism strategies: one module of spmd.parallel per strategy, each defining `STRATEGY`.

A strategy owns its mesh axes, the parallel implementations it hands models (through
spmd.core.logical.provided), the checks a layout must pass, its share of the bytes each device
must send per step (the analytic minimum of `spmd-dryrun`: spmd.analysis.aot sums the strategies'),
and how to recognise its collectives in a compiled program (`spmd-dryrun --explain`:
spmd.analysis.explain tries every strategy's attributions in priority order and takes the first
that matches). A new strategy is one module here plus a rules file; the dry-run and the
explanation find it without an edit.

Attributions come in four scopes, tried in this order for each collective:
- "param": per array of the collective shaped like a parameter's shard (`Seen.params`), with that
  parameter and the dimension gathered (or None);
- "collective": once, on the whole collective;
- "activation": per array of the collective, with the per-device token counts (`Seen.tokens`);
- "late": per array and parameter shape, whatever their shapes (e.g. a weight gathered in a
  transposed layout), once nothing else explained the collective.
Within a scope the items come first (each array, each parameter shape) and the attributions in
priority order inside, so the first item any attribution explains decides. spmd.analysis.explain
adds the partitioner's own (embedding lookups, scalars, resharded activations).
"""

import dataclasses
import functools
import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping

import numpy as np

from spmd.core.mesh import axes_size, platform_of, spec_axes

PACKAGE = "spmd.parallel"

# Logical names whose split makes a contraction's output a partial sum, by where they act (the
# embedding dimension is contracted in every projection into heads or MLP units, and by RMSNorm).
CONTRACTED_IN_LAYERS = ("heads", "kv_heads", "mlp", "head_dim", "expert_mlp", "embed")
CONTRACTED_OUTSIDE = ("vocab", "act_vocab", "embed")
TOKEN_NAMES = ("batch", "seq", "act_seq")
# A gather or a reduce-scatter the compiler ran as an all-reduce (the TPU compiler does so for a
# group spanning a whole slice): it does the job of the one-way collective and sends twice its
# bytes, so half of what these send is the compiler's choice of algorithm, not the sharding's.
AS_ALL_REDUCE_GATHER = "weights gathered (as an all-reduce of zero-padded shards)"
AS_ALL_REDUCE_SCATTER = (
    "gradients reduced (as an all-reduce of the whole gradient; each device keeps its shard)"
)
AS_ALL_REDUCE_UPDATE = "updated parameters gathered (sharded update; as an all-reduce of zero-padded shards)"
AS_ALL_REDUCE = (AS_ALL_REDUCE_GATHER, AS_ALL_REDUCE_SCATTER, AS_ALL_REDUCE_UPDATE)


def names_on(rules, axes, names) -> list[str]:
    """Which of `names` the rules map onto any of `axes`."""
    return [n for n in names if set(rules.mapping.get(n, ())) & set(axes)]


def squeeze(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def rule(names, axes) -> str:
    """How a rule is named in the explanation: "embed -> fsdp"."""
    return f"{'/'.join(names)} -> {','.join(axes)}"


@dataclasses.dataclass(frozen=True)
class Attribution:
    """One way to recognise a strategy's collective. `match(c, seen, *item)` returns (rule, what)
    or None; the item is (shape, param, dim) in the "param" scope, (shape,) in "activation", none
    in "collective"."""

    priority: int
    scope: str  # "first" | "param" | "collective" | "activation" | "late"
    match: Callable


@dataclasses.dataclass
class Strategy:
    """A parallelism strategy (module doc)."""

    name: str  # its share of the analytic minimum is reported under this name
    rank: int  # where its share is reported
    axes: tuple[str, ...] = ()  # the mesh axes it owns
    ops: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    check: Callable | None = None  # (rules, mesh, figures, seq_len) -> list of problems
    minimum: Callable | None = None  # (Step) -> bytes each device sends per step
    attributions: tuple[Attribution, ...] = ()

    def problems(self, rules, mesh, figures, seq_len) -> list[str]:
        return self.check(rules, mesh, figures, seq_len) if self.check else []

    def minimum_bytes(self, step) -> float:
        """Its own bytes, plus the vocabulary's sums where the rules split the vocabulary over its
        name's axis (module `tensor`: vocab_sums)."""
        own = self.minimum(step) if self.minimum else 0.0
        return own + step.vocab_sums(self.name)


@functools.cache
def strategies() -> tuple[Strategy, ...]:
    """Every strategy of the spmd.parallel package, by rank."""
    package = importlib.import_module(PACKAGE)
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        if isinstance(getattr(module, "STRATEGY", None), Strategy):
            found.append(module.STRATEGY)
    return tuple(sorted(found, key=lambda s: s.rank))


def ops() -> dict[str, Callable]:
    """The parallel implementations every strategy hands models."""
    return {name: op for s in strategies() for name, op in s.ops.items()}


def problems(rules, mesh, figures, seq_len: int) -> list[str]:
    """What the layout must change for every strategy to run it."""
    return [p for s in strategies() for p in s.problems(rules, mesh, figures, seq_len)]


def attributions(scope: str, extra=()) -> list[Attribution]:
    """Every strategy's attributions of `scope`, and `extra` ones, in priority order."""
    found = [a for s in strategies() for a in s.attributions] + list(extra)
    return sorted((a for a in found if a.scope == scope), key=lambda a: a.priority)


# --- the step's shape, as the analytic minimum reads it ---------------------------------------


@dataclasses.dataclass
class Step:
    """What one device holds and runs per step, for the strategies' analytic minimum."""

    cfg: object  # spmd.assembly.config.Config
    plan: object  # spmd.parallel.sharding.ShardingPlan

    def __post_init__(self):
        cfg, plan = self.cfg, self.plan
        sizes = self.sizes = dict(plan.mesh.shape)
        self.batch_axes = plan.rules.mapping.get("batch", ())
        self.expert_axes = plan.rules.mapping.get("expert", ())
        self.seq_axes = tuple(
            a for a in plan.rules.mapping.get("seq", ()) if a not in self.batch_axes and sizes.get(a, 1) > 1
        )
        self.grad_axes = self.batch_axes + self.seq_axes
        # Pipeline stages hold different layers: a parameter split over them is never gathered.
        self.stage_axes = plan.schedule.axes if plan.schedule is not None else ()
        self.model = m = cfg.model  # the settings every family has: dtype, remat
        self.fig = fig = plan.family.figures(m, cfg.train.seq_len)
        # Tokens on one device as the layers see them, and the layers it runs: under a pipeline,
        # the rows of its stage (the stage axes do not split them there) through n_layers / S layers.
        self.dp = axes_size(sizes, [a for a in self.batch_axes if a not in self.stage_axes])
        self.n_ctx = axes_size(sizes, self.seq_axes)
        self.B, self.T = cfg.train.global_batch_size // self.dp, cfg.train.seq_len // self.n_ctx
        self.itemsize = np.dtype(m.dtype).itemsize  # activations and cast weights travel in the compute dtype
        # The bytes a matmul reads one weight element as: on TPU, default precision rounds float32
        # operands to bfloat16 (one pass), and the compiler gathers them rounded (seen in its HLO).
        self.read_itemsize = min(self.itemsize, 2) if platform_of(plan.mesh) == "tpu" else self.itemsize
        # An MoE layer's (B, E, C, D) dispatched tokens (capacity path; the dropless path's padded
        # buffers are larger, spmd/parallel/expert_parallel.py).
        self.dispatched = math.prod(fig.dispatched_shape(self.B)) * self.itemsize if fig.n_experts else 0
        self.act = self.B * self.T * fig.d_model * self.itemsize  # one (B, T, D) activation
        self.stages = plan.schedule.stages if plan.schedule is not None else 1
        self.n_layers = fig.n_layers // self.stages

    def weight(self, p) -> tuple[float, float, float, list[str]]:
        """(f, used, read, axes) of parameter `p` (spmd.parallel.sharding.ParamInfo): the devices it
        is gathered over for compute (a batch axis splits it: FSDP; experts split over an axis that
        also carries the batch are never gathered), the share of its stored bytes one element
        takes in the dtype the model uses it in (a weight cast to the compute dtype is gathered
        cast, and its gradient leaves the matmuls and is reduced in that dtype; norm scales and the
        embedding table are used as stored) and as a matmul reads it, and the axes that split it."""
        axes = [a for e in p.spec for a in spec_axes(e)]
        f = axes_size(
            self.sizes,
            [a for a in axes if a in self.batch_axes and a not in self.expert_axes + self.stage_axes],
        )
        used = min(1.0, self.itemsize / p.dtype.itemsize) if p.compute_cast else 1.0
        read = min(1.0, self.read_itemsize / p.dtype.itemsize) if p.compute_cast else 1.0
        return f, used, read, axes

    def grad_factor(self, p) -> float:
        """The bytes of `p`'s gradient as reduced, over `gathered(p)`'s: 1 where it leaves the
        matmuls in the dtype the model uses `p` in; its stored dtype's share under
        train.grad_reduce_dtype = "float32" (models.layers.project)."""
        _, used, _, _ = self.weight(p)
        return 1 / used if self.cfg.train.grad_reduce_dtype == "float32" else 1.0

    def gathered(self, p) -> float:
        """What one device holds of `p` after the FSDP gather, in the dtype the model uses it in."""
        f, used, _, axes = self.weight(p)
        return used * p.bytes_total / (axes_size(self.sizes, axes) / f)

    def vocab_sums(self, axis: str) -> float:
        """The vocabulary split over `axis` where that does not carry the batch (Megatron's
        vocab-parallel embedding and logits): the lookup's rows are summed over it forward (each
        device has the rows of its part of the vocabulary, zeros elsewhere), and the logits' input
        gradient backward: two (B, T, D) all-reduces. (The loss's per-token statistics over it,
        under 1/D of that, are left out.)"""
        vocab = self.plan.rules.mapping.get("vocab", ())
        if axis not in vocab or axis in self.batch_axes + self.expert_axes or self.sizes.get(axis, 1) <= 1:
            return 0.0
        return 2 * 2 * self.act * (self.sizes[axis] - 1) / self.sizes[axis]


def analytic_minimum(cfg, plan) -> dict[str, float]:
    """Lower bound on bytes each device sends per step, by strategy (each module's `minimum`)."""
    step = Step(cfg, plan)
    return {s.name: s.minimum_bytes(step) for s in strategies()}


# --- a compiled collective, as the attributions read it ---------------------------------------


@dataclasses.dataclass
class Seen:
    """One collective of a compiled step (spmd.analysis.hlo.Collective) with what the plan knows
    of it."""

    c: object
    plan: object
    cfg: object

    def __post_init__(self):
        c, plan = self.c, self.plan
        self.rules, self.axes = plan.rules, c.axes
        self.in_layers = "/while/body/" in c.op_name
        self.token_names = names_on(self.rules, self.axes, TOKEN_NAMES)
        self.shapes = c.shapes or ((),)
        self.zero_axes = [a for a in self.axes if a in self.rules.shard_optimizer_over]
        self.schedule = getattr(plan, "schedule", None)
        self.sizes = dict(plan.mesh.shape)

    @functools.cached_property
    def params(self) -> list[tuple]:
        """(shape, param, dim gathered or None) for each shape a parameter can take in this
        collective: its shard, and its shard gathered along a dimension split over its axes; each
        also without the leading `layers` dimension (one layer, inside the scan)."""
        return param_shapes(self.plan, self.axes)

    def tokens(self) -> None:
        """The per-device token counts an activation's leading dims hold (`token_counts`), the
        device's microbatch rows `B`, and the arrays as the activations are read (`activation
        shapes`: inside a pipeline, without the unit stage dim the vmap adds)."""
        cfg, rules, sizes, schedule = self.cfg, self.rules, self.sizes, self.schedule
        batch_split = axes_size(sizes, [a for a in rules.mapping.get("batch", ()) if a in sizes])
        B = max(1, cfg.train.global_batch_size // cfg.train.microbatches // batch_split)
        T, D = cfg.train.seq_len, cfg.model.d_model
        seq_split = axes_size(sizes, [a for a in rules.mapping.get("seq", ()) if a in sizes])
        token_counts = {B * T, B * (T // seq_split), B * (T // max(1, axes_size(sizes, self.axes)))}
        shapes = self.shapes
        if schedule is not None and self.in_layers:
            # Inside the pipeline: one microbatch's rows, under the stage axis the vmap adds (size 1).
            B = max(1, B // schedule.microbatches)
            token_counts = {n // schedule.microbatches for n in token_counts} | token_counts
            shapes = tuple(s[1:] if len(s) > 1 and s[0] == 1 else s for s in shapes)
        self.B, self.D, self.token_counts, self.activation_shapes = B, D, token_counts, shapes
        # Elements of the (B, E, C, D) tokens dispatched to the experts, per device (0: dense).
        figures = self.plan.family.figures(cfg.model, cfg.train.seq_len)
        self.dispatched = math.prod(figures.dispatched_shape(B)) if figures.n_experts else 0

    def holds_tokens(self, shape) -> bool:
        """Whether `shape`'s leading dims hold the device's tokens (an activation)."""
        if not shape:
            return False
        tokens = shape[0] in self.token_counts or (
            len(shape) > 1 and shape[0] * shape[1] in self.token_counts
        )
        return tokens or (len(shape) > 1 and shape[0] == self.B)


def param_shapes(plan, axes) -> list[tuple]:
    """Seen.params for a collective over `axes`."""
    sizes = dict(plan.mesh.shape)
    # Under a sharded weight update the gradient is reduce-scattered into the optimizer's shards.
    z = axes_size(sizes, [a for a in plan.rules.shard_optimizer_over if a in axes])
    out = []
    for p in plan.params:
        variants = [(tuple(p.local_shape), None)]
        for d, entry in enumerate(p.spec):
            on = [a for a in spec_axes(entry) if a in axes]
            if on:
                gathered = list(p.local_shape)
                gathered[d] *= axes_size(sizes, on)
                variants.append((tuple(gathered), d))
        if z > 1:
            for d, n in enumerate(p.local_shape):
                if n % z == 0:
                    variants.append(
                        (tuple(p.local_shape[:d]) + (n // z,) + tuple(p.local_shape[d + 1 :]), None)
                    )
        for shape, d in variants:
            stacked = bool(p.logical) and p.logical[0] == "layers" and len(shape) > 1
            lead, body = (shape[:1], shape[1:]) if stacked else ((), shape)
            shapes = [shape] + ([body] if stacked else [])  # the stack, and one layer inside the scan
            # Projections run flattened to 2-D (the models' `project`); the layers dim stays apart.
            for k in range(1, len(body)):
                flat = (math.prod(body[:k]), math.prod(body[k:]))
                shapes += [lead + flat] + ([flat] if stacked else [])
            out += [(sh, p, d) for sh in dict.fromkeys(shapes)]
    return out
