"""LoRA: low-rank adapters trained on a frozen base model (the `[lora]` table), as a model
transform (spmd.training.transform).

A targeted weight W (a projection the family names in `adapter_targets`: q, k, v, o, gate, up,
down) gets two parameters, A (its input axes x rank) and B (rank x its output axes); the
projection computes x W + (alpha / rank) (x A) B. A starts uniform in +-1/sqrt(fan_in) and B at
zero (as `peft` does), so training starts from the base model's function. The adapters carry
logical axes: the rank axis is `lora_rank` (replicated unless a rules file maps it), the others
are the adapted weight's own, so every rules preset shards them as it shards the weight.

Only the adapters train; the base is frozen (optionally held in bf16, `lora.base_dtype`), so
checkpoints hold the adapters and their optimizer state, and the base is the weights the run
started from (its `--init-from` checkpoint, or its seed). Exports: the merged model
(`spmd-ckpt export-hf --merge`) or a `peft` adapter directory (`export_adapter`).
Legend: R rank; "in"/"out" the adapted weight's contracted and produced axes.
"""

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd.assembly.config import LoRAConfig
from spmd.core.errors import UserError, closest
from spmd.io import checkpoint as ckpt
from spmd.io import hf
from spmd.parallel.sharding import path_str
from spmd.training import transform

# A weight's adapter is its module's attribute PREFIX + the weight's name (checkpoints' paths).
PREFIX = "lora_"
RANK_AXIS = "lora_rank"


class LoRA(transform.ModelTransform):
    """The `[lora]` table's transform: adapters beside the targeted weights; only they train."""

    table = "lora"

    @classmethod
    def from_record(cls, config: dict):
        saved = config.get("lora") or {}
        if not saved.get("rank"):
            return None
        fields = {f.name for f in dataclasses.fields(LoRAConfig)}
        settings = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k in fields}
        return cls(LoRAConfig(**settings), int((config.get("train") or {}).get("seed", 0)))

    def family(self, family):
        cls, settings, seed = family.model_cls, self.settings, self.seed

        def build(cfg, *, rngs):
            return attach(cls(cfg, rngs=rngs), family, settings, seed)

        return dataclasses.replace(
            family, model_cls=build, logical_axes={**family.logical_axes, RANK_AXIS: None}
        )

    def adds(self, path) -> bool:
        return is_adapter(path)

    @property
    def frozen_dtype(self) -> str:
        return self.settings.base_dtype

    @property
    def needs_key(self) -> bool:
        return bool(self.settings.dropout)

    def step_context(self, key):
        return dropout_key(key)

    def off(self, path, value):
        # zero adapters add x A B = 0: exactly the base model, whatever A is
        return jax.numpy.zeros_like(value)

    def merged(self, params: Mapping) -> dict:
        return merged(params, self.settings.scale)

    def plain(self, cfg):
        return dataclasses.replace(cfg, lora=LoRAConfig())


TRANSFORM = LoRA


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
    """A (in..., R) and B (R, out...) of one weight (stacked over its layers like the weight).
    `adapts` names that weight: the model's projection finds its adapter by it
    (spmd.core.family.adapter_of) and adds what the adapter returns."""

    def __init__(self, a, b, a_axes, b_axes, scale: float, dropout: float, adapts: str):
        self.a = nnx.LoRAParam(a, out_sharding=a_axes)
        self.b = nnx.LoRAParam(b, out_sharding=b_axes)
        self.scale, self.dropout, self.adapts = scale, dropout, adapts

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
    known = dict(family.adapter_targets)
    if not known:
        raise UserError(f"model family {family.name} declares no LoRA targets; train it without [lora]")
    wanted = lora.targets or tuple(known)  # empty: every projection the family declares
    unknown = [t for t in wanted if t not in known]
    if unknown:
        raise UserError(
            f"lora.targets: {family.name} has no projection {unknown[0]!r}{closest(unknown[0], list(known))}; "
            f"its targets are {', '.join(known)}"
        )
    return {t: known[t] for t in dict.fromkeys(wanted)}


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
            setattr(module, PREFIX + attr, Adapter(a, b, a_axes, b_axes, lora.scale, lora.dropout, attr))
    missing = [t for t, (attr, _) in targets(family, lora).items() if attr not in found]
    if missing:
        raise UserError(f"lora.targets: this {family.name} model has no {', '.join(missing)} projection")
    return model


def is_adapter(path) -> bool:
    return any(str(getattr(k, "key", k)).startswith(PREFIX) for k in path)


def split(tree: Mapping) -> tuple[dict, dict]:
    """(adapters, base): a parameter tree (or one shaped like it) in its two disjoint halves."""
    return transform.split_tree(tree, is_adapter)


combine = transform.combine


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


# --- a peft adapter directory ---------------------------------------------------------------------

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def export_adapter(path: str, out: str, step: int | None = None, dtype: str | None = None) -> dict:
    """Write a LoRA run's adapters as a `peft` adapter directory (adapter_config.json,
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained` puts on the base model as
    exported by export-hf from the run it started from."""
    from safetensors.numpy import save_file

    directory, latest, meta, cfg = hf.exported(path, step)
    if not cfg.lora.enabled:
        raise UserError(
            f"{directory}/{latest} holds no LoRA adapters (lora.rank = 0); export its weights with export-hf --out DIR"
        )
    mapping = hf.adapter(cfg.model_family)
    tensors = mapping.tensors(cfg.model)
    dtype = dtype or cfg.model.param_dtype
    dest = pathlib.Path(out).expanduser()
    hf.empty_destination(dest, "--out")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    adapters, _ = ckpt.read_trained(directory, latest, device)
    flat = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(adapters)}
    named, modules = {}, set()
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    for key in sorted(k for k in flat if k.endswith("/a")):
        at = key[: -len("/a")]
        parent, name = at.rsplit("/", 1)
        weight = f"{parent}/{name[len(PREFIX) :]}"
        t = tensors[weight]
        if not t.transpose or t.part is not None:  # not one nn.Linear of HF's per weight of ours
            raise UserError(
                f"{weight} is not one Linear layer in {cfg.model_family.name}'s HF model, which peft cannot "
                f"adapt alike; export the merged model with export-hf --merge"
            )
        a, b = flat[key], flat[f"{at}/b"]
        n = t.stacked
        shape = (*a.shape[:-1], *b.shape[n + 1 :])
        for idx, hf_name in hf.hf_names(t, shape):
            module = hf_name.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            rank = a.shape[-1]
            # HF's Linear computes x W^T with W (out, in): its update B_peft A_peft is ours, transposed.
            named[f"base_model.model.{module}.lora_A.weight"] = a[idx].reshape(-1, rank).T.astype(np_dtype)
            named[f"base_model.model.{module}.lora_B.weight"] = b[idx].reshape(rank, -1).T.astype(np_dtype)
    origin = meta["run"].get("hf") or meta["run"].get("init_from", {}).get("hf") or {}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": origin.get("source"),
    }
    tmp = hf.temporary(dest)
    if jax.process_index() == 0:
        named = {
            k: np.ascontiguousarray(v) for k, v in sorted(named.items(), key=lambda kv: hf.natural_key(kv[0]))
        }
        save_file(named, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_WEIGHTS).chmod(0o644)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    hf.sync_processes(f"wrote {tmp}")
    hf.publish(tmp, dest)
    return {"step": latest, "tensors": len(named), "modules": sorted(modules), "rank": cfg.lora.rank}
