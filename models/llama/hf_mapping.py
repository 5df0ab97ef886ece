"""The Llama family's Hugging Face mapping: Llama (2, 3, 3.1+ with llama3 RoPE scaling), Mistral,
Qwen2 and Mixtral, as `transformers` saves them.

Two facts make the mapping exact (checked against transformers' logits, tests/test_hf.py):
transformers' Llama family rotates half-split pairs (dimension i with i + H/2), as models/layers.py
does, so q/k weights need no permutation; and HF's `nn.Linear` stores (out, in), ours (in, out).
"""

import math
from collections.abc import Callable

from spmd.core.errors import UserError
from spmd.core.family import HFAdapter, HFTensor
from spmd.models.decoder import layer_groups
from spmd.models.llama.model import LlamaConfig
from spmd.models.moe import MoEConfig

# architecture -> model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}
# Buffers some older checkpoints saved; recomputed, never parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def rope(hf: dict) -> tuple[float, dict]:
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


class ConfigReader:
    """An HF config.json read for one architecture of a Llama-style decoder (this family's, and
    families built on it: Qwen3): `need(key)`, `refuse(what)` (errors naming the file), and the
    fields every such decoder spells alike."""

    def __init__(self, hf: dict, source: str, arch: str):
        self.hf, self.source, self.arch = hf, source, arch
        if hf.get("hidden_act", "silu") != "silu":
            self.refuse(f"hidden_act={hf['hidden_act']!r} (only silu, SwiGLU)")

    def need(self, key):
        if key not in self.hf:
            raise UserError(f"{self.source}: config.json has no {key!r}, which {self.arch} needs")
        return self.hf[key]

    def refuse(self, what: str):
        raise UserError(
            f"{self.source}: {what} is not supported by this model; it cannot be imported faithfully"
        )

    def decoder_fields(self) -> dict:
        """The decoder's sizes, RoPE base, norm epsilon, tying and init scale."""
        hf, need = self.hf, self.need
        D, N = int(need("hidden_size")), int(need("num_attention_heads"))
        return dict(
            vocab_size=int(need("vocab_size")),
            d_model=D,
            n_layers=int(need("num_hidden_layers")),
            n_heads=N,
            n_kv_heads=int(hf.get("num_key_value_heads") or N),
            head_dim=int(hf.get("head_dim") or D // N),
            d_ff=int(need("intermediate_size")),
            rope_theta=rope(hf)[0],
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )


def model_fields(hf: dict, source: str) -> dict:
    """Our LlamaConfig fields for an HF config.json (as a dict), or an error naming what we
    cannot express."""
    arch = architecture(hf, source)
    reader = ConfigReader(hf, source, arch)
    need, refuse = reader.need, reader.refuse
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
        refuse("attention_bias=true (a bias on o_proj)")
    if hf.get("mlp_bias"):
        refuse("mlp_bias=true")
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", arch in ("MistralForCausalLM", "MixtralForCausalLM"))
    if window and uses_window and window < hf.get("max_position_embeddings", math.inf):
        refuse(f"sliding-window attention (sliding_window={window})")
    fields = {**reader.decoder_fields(), "qkv_bias": arch == "Qwen2ForCausalLM"}
    scaling = rope(hf)[1]
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
        fields["moe"] = MoEConfig(
            n_experts=int(need("num_local_experts")),
            top_k=int(need("num_experts_per_tok")),
            d_ff_expert=fields["d_ff"],
            router_score="softmax",
            dispatch="dropless",  # Mixtral drops no token
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            router_z_loss_coef=0.0,
        )
    return fields


def export_architecture(cfg: LlamaConfig, base: dict | None) -> str:
    """The HF architecture that expresses `cfg` exactly (the imported one when there was one), or
    an error naming what no supported family can express."""
    moe = cfg.moe
    if moe is not None:
        problems = [
            (moe.n_shared_experts, "shared experts"),
            (moe.every != 1, f"dense layers between MoE layers (moe.every={moe.every})"),
            (moe.router_score != "softmax", f"moe.router_score={moe.router_score}"),
            (not moe.normalize_top_k, "moe.normalize_top_k=false"),
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


def decoder_fields(cfg, arch: str, model_type: str) -> dict:
    """The config.json fields of a Llama-style decoder (Llama, Mistral, Qwen2, Qwen3 and their
    MoE forms spell them alike), from a config of this family or one built on it."""
    return dict(
        architectures=[arch],
        model_type=model_type,
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


def hf_config(cfg: LlamaConfig, arch: str, base: dict | None, max_positions: int, dtype: str) -> dict:
    """config.json for `cfg`: the imported config (when there was one) with every field we map
    rewritten from `cfg`, in the same spelling (transformers 5's `rope_parameters` or the older
    `rope_theta`/`rope_scaling`)."""
    out = {**(base or {}), **decoder_fields(cfg, arch, ARCHITECTURES[arch])}
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
            num_local_experts=cfg.moe.n_experts,
            num_experts_per_tok=cfg.moe.top_k,
            intermediate_size=cfg.moe.d_ff_expert or cfg.d_ff,
            router_aux_loss_coef=cfg.moe.aux_loss_coef,
        )
    out["torch_dtype" if "dtype" not in out else "dtype"] = dtype
    return out


def _layer_names(cfg) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """HF layer index of our dense layer i and of our MoE layer g (see spmd.models.decoder.layer_groups)."""
    _, dense_per_group, has_moe = layer_groups(cfg)
    per_group = dense_per_group + has_moe
    return (
        lambda i: (i // dense_per_group) * per_group + i % dense_per_group,
        lambda g: g * per_group + dense_per_group,
    )


# Where an MoE layer's router and experts lie inside an HF layer, and each expert matrix's name.
MIXTRAL_MOE = {
    "router": "block_sparse_moe.gate.weight",
    "expert": "block_sparse_moe.experts.{e}.{w}.weight",
    "w_gate_EDF": "w1",
    "w_up_EDF": "w3",
    "w_down_EFD": "w2",
}


def tensors(cfg: LlamaConfig, moe_names=MIXTRAL_MOE) -> dict[str, HFTensor]:
    """Our parameter path -> its HF tensor(s), for every parameter of `cfg`; `moe_names`: where an
    MoE layer's tensors lie (Mixtral's layout, or a family's own built on this one)."""
    if cfg.moe is not None and cfg.moe.n_shared_experts:
        raise UserError("shared experts have no equivalent in the supported HF families (Mixtral has none)")
    dense_layer, moe_layer = _layer_names(cfg)
    out = {
        "embed_VD": HFTensor(lambda: "model.embed_tokens.weight"),
        "final_norm/scale_D": HFTensor(lambda: "model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["head_DV"] = HFTensor(lambda: "lm_head.weight", transpose=True)
    _, dense_per_group, has_moe = layer_groups(cfg)
    stacks = ([("layers", dense_layer)] if dense_per_group else []) + (
        [("moe_layers", moe_layer)] if has_moe else []
    )
    for stack, hf_layer in stacks:

        def layer(suffix, hf_layer=hf_layer):
            return lambda i: f"model.layers.{hf_layer(i)}.{suffix}"

        out.update(
            {
                f"{stack}/attn_norm/scale_D": HFTensor(layer("input_layernorm.weight"), 1),
                f"{stack}/mlp_norm/scale_D": HFTensor(layer("post_attention_layernorm.weight"), 1),
                f"{stack}/attn/wq_DNH": HFTensor(layer("self_attn.q_proj.weight"), 1, True, ((0,), (1, 2))),
                f"{stack}/attn/wk_DKH": HFTensor(layer("self_attn.k_proj.weight"), 1, True, ((0,), (1, 2))),
                f"{stack}/attn/wv_DKH": HFTensor(layer("self_attn.v_proj.weight"), 1, True, ((0,), (1, 2))),
                f"{stack}/attn/wo_NHD": HFTensor(layer("self_attn.o_proj.weight"), 1, True, ((0, 1), (2,))),
            }
        )
        if cfg.qkv_bias:
            for ours, hf in (("bq_NH", "q_proj"), ("bk_KH", "k_proj"), ("bv_KH", "v_proj")):
                out[f"{stack}/attn/{ours}"] = HFTensor(layer(f"self_attn.{hf}.bias"), 1, groups=((0, 1),))
        if stack == "layers":
            for ours, hf in (("w_gate_DF", "gate_proj"), ("w_up_DF", "up_proj"), ("w_down_FD", "down_proj")):
                out[f"layers/mlp/{ours}"] = HFTensor(layer(f"mlp.{hf}.weight"), 1, True)
        else:
            out["moe_layers/mlp/router_DE"] = HFTensor(layer(moe_names["router"]), 1, True)
            for ours in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
                expert = moe_names["expert"]
                out[f"moe_layers/mlp/{ours}"] = HFTensor(
                    lambda g, e, w=moe_names[ours], hf_layer=hf_layer: (
                        f"model.layers.{hf_layer(g)}." + expert.format(e=e, w=w)
                    ),
                    2,
                    True,
                )
    return out


def unmapped(cfg: LlamaConfig, name: str) -> bool:
    """Tensors in the files that no parameter maps and that import skips: buffers, and the head of
    a tied checkpoint that stores the shared table twice (transformers ignores it too)."""
    return name.endswith(IGNORED_SUFFIXES) or (cfg.tie_embeddings and name == "lm_head.weight")


def export_note(cfg: LlamaConfig) -> str:
    if cfg.moe is not None and cfg.moe.dispatch == "capacity":
        return (
            f"note: this model was trained with capacity dispatch (moe.capacity_factor {cfg.moe.capacity_factor}); "
            f"transformers' Mixtral drops no token, as moe.dispatch=dropless computes here"
        )
    return ""


ADAPTER = HFAdapter(
    architectures=ARCHITECTURES,
    model_fields=model_fields,
    export_architecture=export_architecture,
    hf_config=hf_config,
    tensors=tensors,
    unmapped=unmapped,
    export_note=export_note,
)
