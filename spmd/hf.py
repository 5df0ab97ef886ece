"""Hugging Face checkpoints in and out: Llama (2, 3, 3.1+ with llama3 RoPE scaling), Mistral,
Qwen2 and Mixtral, as `transformers` saves them (`config.json` + safetensors, one file or shards
with an index).

Two facts make the mapping exact (checked against transformers' logits, tests/test_hf.py):
transformers' Llama family rotates half-split pairs (dimension i with i + H/2), as models/layers.py
does, so q/k weights need no permutation; and HF's `nn.Linear` stores (out, in), ours (in, out).

Each of our parameters is described by a `Tensor`: which HF tensor(s) it comes from, whether the
HF matrix is transposed, and how our trailing axes group into HF's (q_proj's N*H rows become our
N and H axes). Stacked axes (layers, experts) run over separate HF tensors. Reading one device's
shard of a parameter reads only the rows and columns it covers from the memory-mapped file
(`safe_open(...).get_slice`), so host memory holds one shard at a time, and each process reads
only what its own devices hold (`jax.make_array_from_callback`).
"""

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import threading
from collections.abc import Callable

import jax
import numpy as np

from spmd.errors import UserError
from spmd.models.llama import ModelConfig, layer_groups
from spmd.sharding import path_str

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Copied from an HF directory into the run dir on import, and out again on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
# Buffers some older checkpoints saved; recomputed, never parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# architecture -> model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}


# --- configs -----------------------------------------------------------------------------------


def _rope(hf: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict or {}), from transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys that published checkpoints use."""
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, ({} if kind == "default" else {**scaling, "rope_type": kind})


def architecture(hf: dict, source: str) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else next((a for a, t in ARCHITECTURES.items() if t == hf.get("model_type")), "")
    if arch not in ARCHITECTURES:
        raise UserError(
            f"{source}: architecture {arch or hf.get('model_type')!r} is not supported; "
            f"import takes {', '.join(ARCHITECTURES)}"
        )
    return arch


def model_fields(hf: dict, source: str) -> dict:
    """Our ModelConfig fields for an HF config.json (as a dict), or an error naming what we
    cannot express."""
    arch = architecture(hf, source)

    def need(key):
        if key not in hf:
            raise UserError(f"{source}: config.json has no {key!r}, which {arch} needs")
        return hf[key]

    def refuse(what: str):
        raise UserError(f"{source}: {what} is not supported by this model; it cannot be imported faithfully")

    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act={hf['hidden_act']!r} (only silu, SwiGLU)")
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
        refuse("attention_bias=true (a bias on o_proj)")
    if hf.get("mlp_bias"):
        refuse("mlp_bias=true")
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", arch in ("MistralForCausalLM", "MixtralForCausalLM"))
    if window and uses_window and window < hf.get("max_position_embeddings", math.inf):
        refuse(f"sliding-window attention (sliding_window={window})")
    D, N = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling = _rope(hf)
    fields = dict(
        vocab_size=int(need("vocab_size")),
        d_model=D,
        n_layers=int(need("num_hidden_layers")),
        n_heads=N,
        n_kv_heads=int(hf.get("num_key_value_heads") or N),
        head_dim=int(hf.get("head_dim") or D // N),
        d_ff=int(need("intermediate_size")),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        qkv_bias=arch == "Qwen2ForCausalLM",
    )
    if scaling:
        if scaling["rope_type"] != "llama3":
            refuse(f"rope scaling of type {scaling['rope_type']!r} (only llama3)")
        fields.update(
            rope_scaling="llama3",
            rope_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_position=int(scaling["original_max_position_embeddings"]),
        )
    if arch == "MixtralForCausalLM":
        fields.update(
            n_experts=int(need("num_local_experts")),
            top_k=int(need("num_experts_per_tok")),
            d_ff_expert=fields["d_ff"],
            router_score="softmax",
            moe_dispatch="dropless",  # Mixtral drops no token
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            router_z_loss_coef=0.0,
        )
    return fields


def export_architecture(cfg: ModelConfig, base: dict | None) -> str:
    """The HF architecture that expresses `cfg` exactly (the imported one when there was one), or
    an error naming what no supported family can express."""
    if cfg.n_experts:
        problems = [
            (cfg.n_shared_experts, "shared experts"),
            (cfg.moe_every != 1, f"dense layers between MoE layers (moe_every={cfg.moe_every})"),
            (cfg.router_score != "softmax", f"router_score={cfg.router_score}"),
            (cfg.qkv_bias, "q/k/v biases in an MoE model"),
        ]
        for bad, what in problems:
            if bad:
                raise UserError(f"cannot export: {what}: MixtralForCausalLM has no equivalent")
        return "MixtralForCausalLM"
    if base and architecture(base, "the imported config") != "MixtralForCausalLM":
        arch = architecture(base, "the imported config")
        if cfg.qkv_bias == (arch == "Qwen2ForCausalLM"):
            return arch
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, arch: str, base: dict | None, max_positions: int, dtype: str) -> dict:
    """config.json for `cfg`: the imported config (when there was one) with every field we map
    rewritten from `cfg`, in the same spelling (transformers 5's `rope_parameters` or the older
    `rope_theta`/`rope_scaling`)."""
    out = dict(base or {})
    out.update(
        architectures=[arch],
        model_type=ARCHITECTURES[arch],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
    )
    out.setdefault("max_position_embeddings", max_positions)
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
        }
    if "rope_parameters" in out:
        out["rope_parameters"] = {"rope_theta": cfg.rope_theta, **(scaling or {"rope_type": "default"})}
    else:
        out.update(rope_theta=cfg.rope_theta, rope_scaling=scaling)
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        out["sliding_window"] = None
    if arch == "Qwen2ForCausalLM":
        out.update(use_sliding_window=False)
    if arch == "MixtralForCausalLM":
        out.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            intermediate_size=cfg.d_ff_expert or cfg.d_ff,
            router_aux_loss_coef=cfg.aux_loss_coef,
        )
    out["torch_dtype" if "dtype" not in out else "dtype"] = dtype
    return out


# --- tensors -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
    """How one of our parameters is stored in HF's files.

    Our array has `stacked` leading axes (layers, then experts) that index separate HF tensors
    (`name(*indices)`); each HF tensor, transposed when `transpose` (HF Linear is (out, in)),
    reshapes to our per-layer shape by splitting its axes into the `groups` of our axes: q_proj
    (N*H, D) transposed is (D, N*H), our (D, N, H) with groups ((0,), (1, 2)).
    """

    name: Callable[..., str]
    stacked: int = 0
    transpose: bool = False
    groups: tuple[tuple[int, ...], ...] = ()

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape for our (per-layer) `shape`."""
        dims = tuple(math.prod(shape[d] for d in g) for g in self._groups(shape))
        return dims[::-1] if self.transpose else dims

    def _groups(self, shape):
        return self.groups or tuple((d,) for d in range(len(shape)))

    def read(self, tensor_slice, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """Our per-layer array's `index` block, reading from the HF tensor only the rows/columns
        that cover it (for a grouped axis: whole inner groups, e.g. whole heads)."""
        groups = self._groups(shape)
        ranges = [index[d].indices(shape[d])[:2] for d in range(len(shape))]
        hf_index, block_shape = [], []
        for g in groups:
            inner = math.prod(shape[d] for d in g[1:])
            start, stop = ranges[g[0]]
            hf_index.append(slice(start * inner, stop * inner))
            block_shape += [stop - start, *(shape[d] for d in g[1:])]
        block = tensor_slice[tuple(hf_index[::-1] if self.transpose else hf_index)]
        block = (block.T if self.transpose else block).reshape(block_shape)
        local = tuple(slice(None) if d == g[0] else slice(*ranges[d]) for g in groups for d in g)
        return block[local]

    def write(self, ours: np.ndarray) -> np.ndarray:
        """The HF tensor for our per-layer array (the inverse of `read` on the whole array)."""
        dims = tuple(math.prod(ours.shape[d] for d in g) for g in self._groups(ours.shape))
        flat = ours.reshape(dims)
        return np.ascontiguousarray(flat.T if self.transpose else flat)


def _layer_names(cfg: ModelConfig) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """HF layer index of our dense layer i and of our MoE layer g (see spmd.models.llama.layer_groups)."""
    _, dense_per_group, has_moe = layer_groups(cfg)
    per_group = dense_per_group + has_moe
    return (
        lambda i: (i // dense_per_group) * per_group + i % dense_per_group,
        lambda g: g * per_group + dense_per_group,
    )


def tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Our parameter path -> its HF tensor(s), for every parameter of `cfg`."""
    if cfg.n_shared_experts:
        raise UserError("shared experts have no equivalent in the supported HF families (Mixtral has none)")
    dense_layer, moe_layer = _layer_names(cfg)
    out = {
        "embed_VD": Tensor(lambda: "model.embed_tokens.weight"),
        "final_norm/scale_D": Tensor(lambda: "model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["head_DV"] = Tensor(lambda: "lm_head.weight", transpose=True)
    _, dense_per_group, has_moe = layer_groups(cfg)
    stacks = ([("layers", dense_layer)] if dense_per_group else []) + (
        [("moe_layers", moe_layer)] if has_moe else []
    )
    for stack, hf_layer in stacks:

        def layer(suffix, hf_layer=hf_layer):
            return lambda i: f"model.layers.{hf_layer(i)}.{suffix}"

        out.update(
            {
                f"{stack}/attn_norm/scale_D": Tensor(layer("input_layernorm.weight"), 1),
                f"{stack}/mlp_norm/scale_D": Tensor(layer("post_attention_layernorm.weight"), 1),
                f"{stack}/attn/wq_DNH": Tensor(layer("self_attn.q_proj.weight"), 1, True, ((0,), (1, 2))),
                f"{stack}/attn/wk_DKH": Tensor(layer("self_attn.k_proj.weight"), 1, True, ((0,), (1, 2))),
                f"{stack}/attn/wv_DKH": Tensor(layer("self_attn.v_proj.weight"), 1, True, ((0,), (1, 2))),
                f"{stack}/attn/wo_NHD": Tensor(layer("self_attn.o_proj.weight"), 1, True, ((0, 1), (2,))),
            }
        )
        if cfg.qkv_bias:
            for ours, hf in (("bq_NH", "q_proj"), ("bk_KH", "k_proj"), ("bv_KH", "v_proj")):
                out[f"{stack}/attn/{ours}"] = Tensor(layer(f"self_attn.{hf}.bias"), 1, groups=((0, 1),))
        if stack == "layers":
            for ours, hf in (("w_gate_DF", "gate_proj"), ("w_up_DF", "up_proj"), ("w_down_FD", "down_proj")):
                out[f"layers/mlp/{ours}"] = Tensor(layer(f"mlp.{hf}.weight"), 1, True)
        else:
            out["moe_layers/mlp/router_DE"] = Tensor(layer("block_sparse_moe.gate.weight"), 1, True)
            for ours, hf in (("w_gate_EDF", "w1"), ("w_up_EDF", "w3"), ("w_down_EFD", "w2")):
                out[f"moe_layers/mlp/{ours}"] = Tensor(
                    lambda g, e, hf=hf, hf_layer=hf_layer: (
                        f"model.layers.{hf_layer(g)}.block_sparse_moe.experts.{e}.{hf}.weight"
                    ),
                    2,
                    True,
                )
    return out


def hf_names(t: Tensor, shape: tuple[int, ...]):
    """(stacked index, HF name) for every HF tensor behind one of our parameters."""
    for idx in np.ndindex(*shape[: t.stacked]):
        yield idx, t.name(*idx)


# --- reading safetensors -----------------------------------------------------------------------


class Weights:
    """The tensors of an HF directory: one model.safetensors or the shards an index names. Only
    the headers are read here; each read maps its file, copies the asked-for block out and unmaps
    it, so the file's pages do not stay in this process's memory."""

    def __init__(self, hf_dir: pathlib.Path):
        self.dir = hf_dir
        index = hf_dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, UnicodeDecodeError) as e:
                raise UserError(f"{index} is not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
        elif (hf_dir / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise UserError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX}")
        self.where, self.shapes = {}, {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise UserError(f"{index} names the shard {name}, which is missing from {hf_dir}")
            try:
                with self._open(name) as handle:
                    shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
            except Exception as e:  # noqa: BLE001 — safetensors raises its own error types for bad files
                raise UserError(
                    f"{path} is not a readable safetensors file ({e}); is it truncated?"
                ) from None
            for k, shape in shapes.items():
                self.where[k], self.shapes[k] = name, shape
        if weight_map is not None:
            for k, name in weight_map.items():
                if self.where.get(k) != name:
                    raise UserError(f"{index} places {k} in {name}, but that file does not hold it")

    def _open(self, file: str):
        from safetensors import safe_open

        return safe_open(str(self.dir / file), framework="numpy")

    def read(self, name: str, t: "Tensor", shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        with self._open(self.where[name]) as handle:
            return t.read(handle.get_slice(name), shape, index)


def check_tensors(weights: Weights, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Before anything is read: every tensor our config needs is present with the shape it
    implies, and every tensor in the files is one we map."""
    used = set()
    for path, t in tensors(cfg).items():
        shape = shapes[path]
        want = t.hf_shape(shape[t.stacked :])
        for _, name in hf_names(t, shape):
            if name not in weights.shapes:
                raise UserError(f"{weights.dir}: tensor {name} is missing (needed for our {path})")
            if weights.shapes[name] != want:
                raise UserError(
                    f"{weights.dir}: tensor {name} has shape {list(weights.shapes[name])} but config.json "
                    f"implies {list(want)}; the config does not match the weights"
                )
            used.add(name)
    for name in sorted(weights.shapes):
        if name in used or name.endswith(IGNORED_SUFFIXES):
            continue
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue  # some tied checkpoints store the shared table twice; transformers ignores it too
        raise UserError(f"{weights.dir}: tensor {name} has no place in this model (an unmapped tensor)")


READ_BUDGET = 1 << 30  # bytes of shards being built at once (one larger shard is always allowed)


class _Budget:
    """Blocks a thread until its bytes fit under the limit (or nothing else is in flight)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def holding(self, n: int):
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            with self.cond:
                self.used -= n
                self.cond.notify_all()


def _shard_bytes(x) -> int:
    """Bytes of all of this process's shards of x (what building it holds on the host at once)."""
    local = x.sharding.shard_shape(x.shape)
    n_local = len(x.sharding.addressable_devices)
    return math.prod(local) * np.dtype(x.dtype).itemsize * n_local


def load_params(weights: Weights, cfg: ModelConfig, abstract_params: dict) -> dict:
    """Our parameters, each built shard by shard on its target sharding from the files."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(abstract_params)}
    mapping = tensors(cfg)
    check_tensors(weights, cfg, {p: tuple(x.shape) for p, x in flat.items()})

    def build(path, x):
        t, shape = mapping[path], tuple(x.shape)
        inner = shape[t.stacked :]

        def shard(index):
            lead = [range(*s.indices(n)) for s, n in zip(index[: t.stacked], shape)]
            blocks = [
                weights.read(t.name(*idx), t, inner, index[t.stacked :]).astype(x.dtype, copy=False)
                for idx in _product(lead)
            ]
            if not t.stacked:
                return blocks[0]
            return np.stack(blocks).reshape([len(r) for r in lead] + list(blocks[0].shape))

        with budget.holding(_shard_bytes(x)):
            return jax.make_array_from_callback(shape, x.sharding, shard)

    # Parameters are read in parallel (the copies and transposes release the GIL; reads from the
    # page cache are memory-bound), with at most READ_BUDGET bytes of shards in flight at once.
    budget = _Budget(READ_BUDGET)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        built = dict(zip(flat, pool.map(lambda item: build(*item), flat.items())))
    return jax.tree_util.tree_map_with_path(lambda p, _: built[path_str(p)], abstract_params)


def hf_tensors(cfg: ModelConfig, params: dict, dtype) -> dict[str, tuple[Callable[[], np.ndarray], int]]:
    """HF name -> (a function giving the tensor, its bytes), in HF's order (layer by layer). Each
    call brings only its own layer (and expert) of a stacked parameter to the host, then lays it
    out as HF does."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    out = {}
    for path, t in tensors(cfg).items():
        x = flat[path]
        n_bytes = math.prod(x.shape[t.stacked :]) * np.dtype(dtype).itemsize
        for idx, name in hf_names(t, tuple(x.shape)):
            out[name] = (
                lambda x=x, idx=idx, t=t: t.write(_to_host(x, idx)).astype(dtype, copy=False),
                n_bytes,
            )
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def _to_host(x: jax.Array, idx: tuple[int, ...]) -> np.ndarray:
    """x[idx] on the host. An array on one CPU device is host memory already (a view, no copy);
    elsewhere the slice is cut where x lives, so only it crosses to the host (gathered from every
    process when x spans several)."""
    if len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu":
        return np.asarray(x)[idx]
    part = x[idx] if idx else x
    if part.is_fully_addressable:
        return np.asarray(part)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(part, tiled=True))


def _natural(name: str):
    """model.layers.10 after model.layers.9."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _product(ranges):
    return [()] if not ranges else [(i, *rest) for i in ranges[0] for rest in _product(ranges[1:])]


# --- whole directories -------------------------------------------------------------------------


def _read_json(path: pathlib.Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is not a JSON object")
    return doc


def _empty_destination(path: pathlib.Path, flag: str, overwrite: bool = False) -> None:
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a file; give a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(f"{flag} {str(path)!r} already holds files; give a new directory")


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _publish(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    """Move a finished temporary directory into place (process 0), so a failure leaves nothing."""
    import shutil

    if jax.process_index() == 0:
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    _sync(f"published {dest}")


def _temporary(dest: pathlib.Path) -> pathlib.Path:
    """A fresh temporary directory beside `dest` (one name for all processes: a shared filesystem)."""
    import shutil

    tmp = dest.parent / f".{dest.name}.tmp"
    if jax.process_index() == 0:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _sync(f"made {tmp}")
    return tmp


def import_hf(
    hf_dir: str,
    run_dir: str,
    mesh: str = "fsdp=-1",
    rules: str = "fsdp",
    overrides=(),
    dcn_mesh: str = "",
    overwrite: bool = False,
) -> dict:
    """Write a run dir holding an HF model: config.toml (which `--config` takes), config.json, the
    tokenizer files, and checkpoints/0 with the parameters only (no optimizer state) laid out for
    `mesh` x `rules`. Everything is validated before anything is written; the run dir appears
    whole or not at all."""
    import shutil

    from spmd.checkpoint import META_VERSION, Checkpointer
    from spmd.config import CheckpointConfig, Config, DataConfig, TrainConfig, apply_overrides, to_toml
    from spmd.setup import assemble

    src = pathlib.Path(hf_dir).expanduser()
    if not src.is_dir():
        raise UserError(f"Hugging Face directory {str(src)!r} not found")
    if not (src / CONFIG).is_file():
        raise UserError(f"{src} has no {CONFIG}; give the directory save_pretrained wrote")
    hf = _read_json(src / CONFIG)
    arch = architecture(hf, str(src / CONFIG))
    generation = _read_json(src / GENERATION_CONFIG) if (src / GENERATION_CONFIG).is_file() else None
    dest = pathlib.Path(run_dir).expanduser()
    _empty_destination(dest, "--run-dir", overwrite)
    base = Config(
        name=dest.name, model=ModelConfig(**model_fields(hf, str(src / CONFIG))), train=TrainConfig(),
        data=DataConfig(),
    )  # fmt: skip
    cfg = apply_overrides(base, overrides)
    weights = Weights(src)
    setup = assemble(cfg, mesh, rules, dcn_mesh=dcn_mesh, optimizer=False)
    params = load_params(weights, cfg.model, setup.plan.abstract_params)

    run = {
        **setup.to_json(),
        "hf": {
            "source": str(src.resolve()),
            "architecture": arch,
            "config": hf,
            "generation_config": generation,
        },
    }
    meta = {
        "version": META_VERSION,
        "step": 0,
        "consumed_samples": 0,
        "global_batch_size": cfg.train.global_batch_size,
        "seq_len": cfg.train.seq_len,
        "seed": cfg.train.seed,
        "params_only": True,
        "run": run,
    }
    tmp = _temporary(dest)
    writer = Checkpointer(tmp, CheckpointConfig(async_save=False))
    writer.save(0, {"params": params}, meta)
    writer.close()
    copied = []
    if jax.process_index() == 0:
        (tmp / "config.toml").write_text(to_toml(cfg))
        (tmp / "config.json").write_text(json.dumps(run, indent=2))
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
                copied.append(name)
    _publish(tmp, dest)
    n_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return {"architecture": arch, "config": cfg, "tensors": len(weights.shapes), "bytes": n_bytes,
            "tokenizer": copied}  # fmt: skip


def export_hf(
    path: str,
    out: str,
    step: int | None = None,
    dtype: str | None = None,
    mesh: str = "fsdp=-1",
    rules: str = "fsdp",
    max_shard_bytes: int = 5 * 10**9,
) -> dict:
    """Write an HF directory (config.json, generation_config.json, safetensors shards of at most
    `max_shard_bytes` with their index, the run's tokenizer) from a checkpoint on any mesh.
    Tensors are written in `dtype` (default: the parameters' own)."""
    import shutil

    from safetensors.numpy import save_file

    from spmd import checkpoint as ckpt
    from spmd.config import config_from_json
    from spmd.setup import assemble

    directory, latest = ckpt.locate(path)
    if step is not None:
        if step not in ckpt.committed_steps(directory):
            raise UserError(f"no committed checkpoint for step {step} in {directory}")
        latest = step
    meta = ckpt.check_meta(directory, latest, ckpt.read_meta(directory, latest), ("run",))
    cfg = config_from_json(meta["run"]["config"])
    origin = meta["run"].get("hf") or meta["run"].get("init_from", {}).get("hf") or {}
    arch = export_architecture(cfg.model, origin.get("config"))
    dtype = dtype or cfg.model.param_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if max_shard_bytes < 1:
        raise UserError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    dest = pathlib.Path(out).expanduser()
    _empty_destination(dest, "--out")
    config = hf_config(cfg.model, arch, origin.get("config"), cfg.train.seq_len, dtype)
    tensors(cfg.model)  # raises for what HF cannot express, before anything is read

    setup = assemble(cfg, mesh, rules, optimizer=False, batch_size=0)
    params, _ = ckpt.restore_params(directory, latest, setup.plan.abstract_params)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    named = hf_tensors(cfg.model, params, np_dtype)

    shards, current, size = [], [], 0
    for name, (_, n_bytes) in named.items():
        if current and size + n_bytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n_bytes
    shards.append(current)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    tmp = _temporary(dest)
    is_main = jax.process_index() == 0
    weight_map, total = {}, 0
    for file, names in zip(files, shards):
        if jax.process_count() > 1:  # every process takes part in each gather, in one order
            arrays = {n: named[n][0]() for n in names}
        else:
            with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                arrays = dict(zip(names, pool.map(lambda n: named[n][0](), names)))
        if is_main:
            save_file(arrays, str(tmp / file), metadata={"format": "pt"})
            (tmp / file).chmod(0o644)  # safetensors writes through a private temporary file
        for n in names:
            weight_map[n] = file
            total += arrays[n].nbytes
        del arrays
    if is_main:
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        generation = origin.get("generation_config") or {
            k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None
        }
        (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
        run_dir = ckpt.run_dir_of(directory)
        for name in TOKENIZER_FILES:
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, tmp / name)
    _sync(f"wrote {tmp}")
    _publish(tmp, dest)
    note = ""
    if cfg.model.n_experts and cfg.model.moe_dispatch == "capacity":
        note = (
            f"note: this model was trained with capacity dispatch (capacity_factor {cfg.model.capacity_factor}); "
            f"transformers' Mixtral drops no token, as model.moe_dispatch=dropless computes here"
        )
    return {"architecture": arch, "step": latest, "files": files, "tensors": len(named), "bytes": total,
            "capacity_note": note}  # fmt: skip
