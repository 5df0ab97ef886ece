"""LoRA: low-rank adapters trained on a frozen base model (the `[lora]` table).

A targeted weight W (a projection the family names: q, k, v, o, gate, up, down) gets two
parameters, A (its input axes x rank) and B (rank x its output axes); the projection computes
x W + (alpha / rank) (x A) B. A starts uniform in +-1/sqrt(fan_in) and B at zero (as `peft`
does), so training starts from the base model's function. The adapters carry logical axes: the
rank axis is `lora_rank` (replicated unless a rules file maps it), the others are the adapted
weight's own, so every rules preset shards them as it shards the weight.

The train state holds the adapters as its `params` (they alone get gradients and optimizer state)
and the frozen base weights as `base` (optionally in bf16, `lora.base_dtype`); checkpoints hold the
adapters, the optimizer state and a reference to the base (the `--init-from` checkpoint, or the
seed). Legend: R rank; "in"/"out" the adapted weight's contracted and produced axes.
"""

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.core.errors import UserError, closest
from spmd.core.family import ADAPTER_PREFIX as PREFIX
from spmd.parallel.sharding import path_str

RANK_AXIS = "lora_rank"
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 0  # 0: no adapters, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input, in training
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    base_dtype: str = ""  # the frozen weights' dtype: "" keeps model.param_dtype; bfloat16 halves them

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> list[str]:
        problems = []
        if self.rank < 0:
            problems.append(f"lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        if not 0 < self.alpha < float("inf"):
            problems.append(f"lora.alpha must be a positive number, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            problems.append(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.enabled and not self.targets:
            problems.append("lora.targets is empty; name the projections to adapt, e.g. q,v")
        if self.base_dtype not in ("", *DTYPES):
            problems.append(f"lora.base_dtype must be float32, bfloat16 or float16, got {self.base_dtype!r}")
        return problems


def merged_config(cfg):
    """A run config (spmd.assembly.config.Config) for its merged model: without adapters (rank 0)."""
    return dataclasses.replace(cfg, lora=LoRAConfig()) if cfg.lora.enabled else cfg


# --- the adapter ---------------------------------------------------------------------------------

_DROPOUT_KEY = None  # set while the train step traces (dropout_key); evaluation runs without


class dropout_key:  # noqa: N801 — a context manager, used as `with dropout_key(key):`
    """While tracing the train step: the key the adapters' dropout draws from."""

    def __init__(self, key):
        self.key = key

    def __enter__(self):
        global _DROPOUT_KEY
        self.previous, _DROPOUT_KEY = _DROPOUT_KEY, self.key

    def __exit__(self, *exc):
        global _DROPOUT_KEY
        _DROPOUT_KEY = self.previous


def _contract(x, w, n: int):
    """x's last n axes contracted with w's first n."""
    return jax.lax.dot_general(
        x, w.astype(x.dtype), ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    )


class Adapter(nnx.Module):
    """A (in..., R) and B (R, out...) of one weight (stacked over its layers like the weight)."""

    def __init__(self, a, b, a_axes, b_axes, scale: float, dropout: float):
        self.a = nnx.LoRAParam(a, out_sharding=a_axes)
        self.b = nnx.LoRAParam(b, out_sharding=b_axes)
        self.scale, self.dropout = scale, dropout

    def __call__(self, x, n_in: int, lead_axes=None):
        """(alpha / R) (dropout(x) A) B, in x's dtype: x's last n_in axes are the weight's input."""
        if self.dropout and _DROPOUT_KEY is not None:
            # One layer body is traced for every layer of the scan, so the key is salted with this
            # layer's own A (distinct per layer and step) for masks independent across layers.
            salt = jax.lax.bitcast_convert_type(
                jax.lax.stop_gradient(self.a[...]).reshape(-1)[0].astype(jnp.float32), jnp.uint32
            )
            keep = jax.random.bernoulli(jax.random.fold_in(_DROPOUT_KEY, salt), 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)
        x_R = _contract(x, self.a[...], n_in)  # (..., in) (in, R) -> (..., R)
        return (_contract(x_R, self.b[...], 1) * self.scale).astype(
            x.dtype
        )  # (..., R) (R, out) -> (..., out)


# --- attaching adapters to a family's model ------------------------------------------------------


def targets(family, lora: LoRAConfig) -> dict[str, tuple[str, int]]:
    """{target: (weight attribute, contracted axes)} for lora.targets, or an error naming the
    family's targets."""
    known = dict(family.lora_targets)
    if not known:
        raise UserError(f"model family {family.name} declares no LoRA targets; train it without [lora]")
    unknown = [t for t in lora.targets if t not in known]
    if unknown:
        raise UserError(
            f"lora.targets: {family.name} has no projection {unknown[0]!r}{closest(unknown[0], list(known))}; "
            f"its targets are {', '.join(known)}"
        )
    return {t: known[t] for t in dict.fromkeys(lora.targets)}


def _stacked(axes) -> int:
    """How many leading axes of a parameter index its copies (layers of a stack)."""
    n = 0
    while n < len(axes) and axes[n] == "layers":
        n += 1
    return n


def attach(model, family, lora: LoRAConfig, seed: int):
    """`model` with an Adapter beside each targeted weight (in place; returns it)."""
    wanted = {attr: n_in for attr, n_in in targets(family, lora).values()}
    key = jax.random.fold_in(jax.random.key(seed), 0x10AA)
    found = set()
    for i, (_, module) in enumerate(sorted(nnx.iter_modules(model), key=lambda pm: path_str(pm[0]))):
        for attr, n_in in wanted.items():
            w = getattr(module, attr, None)
            if not isinstance(w, nnx.Param):
                continue
            found.add(attr)
            axes = tuple(w.get_metadata().get("out_sharding") or (None,) * w.ndim)
            lead = _stacked(axes)
            shape = tuple(w.shape)
            fan_in, fan_out = math.prod(shape[lead : lead + n_in]), math.prod(shape[lead + n_in :])
            if lora.rank > min(fan_in, fan_out):
                raise UserError(
                    f"lora.rank ({lora.rank}) is larger than {attr} ({fan_in} x {fan_out}) can hold; "
                    f"choose lora.rank <= {min(fan_in, fan_out)}"
                )
            dtype = w.dtype
            bound = 1 / math.sqrt(fan_in)
            a_shape = (*shape[: lead + n_in], lora.rank)
            a = jax.random.uniform(
                jax.random.fold_in(key, i * 64 + len(found)), a_shape, dtype, -bound, bound
            )
            b = jnp.zeros((*shape[:lead], lora.rank, *shape[lead + n_in :]), dtype)
            a_axes = (*axes[: lead + n_in], RANK_AXIS)
            b_axes = (*axes[:lead], RANK_AXIS, *axes[lead + n_in :])
            setattr(module, PREFIX + attr, Adapter(a, b, a_axes, b_axes, lora.scale, lora.dropout))
    missing = [t for t, (attr, _) in targets(family, lora).items() if attr not in found]
    if missing:
        raise UserError(f"lora.targets: this {family.name} model has no {', '.join(missing)} projection")
    return model


def adapted_family(family, lora: LoRAConfig, seed: int):
    """`family` whose model is built with adapters attached, and knows the rank axis."""
    cls = family.model_cls

    def build(cfg, *, rngs):
        return attach(cls(cfg, rngs=rngs), family, lora, seed)

    return dataclasses.replace(family, model_cls=build, logical_axes={**family.logical_axes, RANK_AXIS: None})


# --- the two halves of the parameters ------------------------------------------------------------


def is_adapter(path) -> bool:
    return any(str(getattr(k, "key", k)).startswith(PREFIX) for k in path)


def split(tree: Mapping) -> tuple[dict, dict]:
    """(adapters, base): a parameter tree (or one shaped like it) in its two disjoint halves."""

    def part(node, path, want):
        if not isinstance(node, Mapping):
            return node if is_adapter(path) == want else None
        out = {}
        for k, v in node.items():
            sub = part(v, (*path, k), want)
            if sub is not None and not (isinstance(sub, Mapping) and not sub):
                out[k] = sub
        return out

    return part(tree, (), True), part(tree, (), False)


def combine(adapters: Mapping, base: Mapping) -> dict:
    """The whole parameter tree from its halves (no copies: the leaves are shared)."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = combine(v, out[k]) if isinstance(v, Mapping) and k in out else v
    return out


def merged(params: Mapping, scale: float) -> dict:
    """The base weights with each adapter folded in, W + scale A B, in W's dtype (computed in
    float32): a tree without adapters, for export and fast decoding."""
    adapters, base = split(params)
    flat_a = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(adapters)}

    def fold(path, w):
        p = path_str(path)
        parent, name = p.rsplit("/", 1) if "/" in p else ("", p)
        at = f"{parent}/{PREFIX}{name}" if parent else PREFIX + name
        if f"{at}/a" not in flat_a:
            return w
        return _fold(w, flat_a[f"{at}/a"], flat_a[f"{at}/b"], scale)

    return jax.tree_util.tree_map_with_path(fold, base)


def _fold(w, a, b, scale):
    """W + scale A B for stacked W (lead..., in..., out...), A (lead..., in..., R), B (lead..., R, out...)."""
    n = a.ndim + b.ndim - 2 - w.ndim  # the leading (stacked) axes: a and b have one rank axis each
    letters = "abcdefghijklmnopqrstuvwxyz"
    n_in = a.ndim - 1 - n
    lead, ins, outs = letters[:n], letters[n : n + n_in], letters[n + n_in : w.ndim]
    update = jnp.einsum(
        f"{lead}{ins}z,{lead}z{outs}->{lead}{ins}{outs}", a.astype(jnp.float32), b.astype(jnp.float32)
    )
    return (w.astype(jnp.float32) + scale * update).astype(w.dtype)
