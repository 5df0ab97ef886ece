"""The Qwen3 family's Hugging Face mapping: `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` as
`transformers` saves them: the Llama layout (spmd.models.llama.hf_mapping), each layer's q/k norms,
and Qwen3-MoE's router and experts under `mlp`."""

from spmd.core.errors import UserError
from spmd.core.family import HFAdapter, HFTensor
from spmd.models.llama import hf_mapping as llama
from spmd.models.moe import MoEConfig
from spmd.models.qwen3.model import Qwen3Config

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
QWEN3_MOE = {
    "router": "mlp.gate.weight",
    "expert": "mlp.experts.{e}.{w}.weight",
    "w_gate_EDF": "gate_proj",
    "w_up_EDF": "up_proj",
    "w_down_EFD": "down_proj",
}


def model_fields(hf: dict, source: str) -> dict:
    """Our Qwen3Config fields for an HF config.json, or an error naming what we cannot express: the
    Llama-style decoder's (spmd.models.llama.hf_mapping.ConfigReader), and Qwen3-MoE's experts."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else {t: a for a, t in ARCHITECTURES.items()}.get(hf.get("model_type"), "")
    reader = llama.ConfigReader(hf, source, arch)
    need, refuse = reader.need, reader.refuse
    if hf.get("attention_bias"):
        refuse("attention_bias=true")
    if hf.get("use_sliding_window"):
        refuse(f"sliding-window attention (sliding_window={hf.get('sliding_window')})")
    fields = reader.decoder_fields()
    scaling = llama.rope(hf)[1]
    if scaling:
        refuse(f"rope scaling of type {scaling['rope_type']!r}")
    if arch == "Qwen3MoeForCausalLM":
        if hf.get("mlp_only_layers"):
            refuse(f"mlp_only_layers={hf['mlp_only_layers']} (dense layers at chosen places)")
        n_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if n_experts is None:
            need("num_experts")
        fields["moe"] = MoEConfig(
            n_experts=int(n_experts),
            top_k=int(need("num_experts_per_tok")),
            every=int(hf.get("decoder_sparse_step", 1)),
            d_ff_expert=int(need("moe_intermediate_size")),
            router_score="softmax",
            normalize_top_k=bool(hf.get("norm_topk_prob", False)),
            dispatch="dropless",  # Qwen3-MoE drops no token
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            router_z_loss_coef=0.0,
        )
    return fields


def export_architecture(cfg: Qwen3Config, base: dict | None) -> str:
    """Qwen3ForCausalLM, or Qwen3MoeForCausalLM for a mixture of experts it expresses."""
    moe = cfg.moe
    if moe is None:
        if cfg.qkv_bias:
            raise UserError("cannot export: q/k/v biases: Qwen3ForCausalLM has no equivalent")
        return "Qwen3ForCausalLM"
    for bad, what in (
        (moe.n_shared_experts, "shared experts"),
        (moe.router_score != "softmax", f"moe.router_score={moe.router_score}"),
        (cfg.qkv_bias, "q/k/v biases"),
    ):
        if bad:
            raise UserError(f"cannot export: {what}: Qwen3MoeForCausalLM has no equivalent")
    return "Qwen3MoeForCausalLM"


def hf_config(cfg: Qwen3Config, arch: str, base: dict | None, max_positions: int, dtype: str) -> dict:
    """config.json for `cfg`: the imported config (when there was one) with every field we map
    rewritten from `cfg`."""
    out = {**(base or {}), **llama.decoder_fields(cfg, arch, ARCHITECTURES[arch])}
    out.update(attention_bias=False, use_sliding_window=False)
    out.setdefault("max_position_embeddings", max_positions)
    if "rope_parameters" in out or not base:
        out["rope_parameters"] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    else:
        out.update(rope_theta=cfg.rope_theta, rope_scaling=None)
    if cfg.moe is not None:
        out.update(
            num_experts=cfg.moe.n_experts,
            num_experts_per_tok=cfg.moe.top_k,
            decoder_sparse_step=cfg.moe.every,
            moe_intermediate_size=cfg.moe.d_ff_expert or cfg.d_ff,
            norm_topk_prob=cfg.moe.normalize_top_k,
            router_aux_loss_coef=cfg.moe.aux_loss_coef,
            mlp_only_layers=[],
        )
    out["torch_dtype" if "dtype" not in out else "dtype"] = dtype
    return out


def tensors(cfg: Qwen3Config) -> dict[str, HFTensor]:
    """Llama's tensors (Qwen3-MoE's expert names), and each layer's q/k norm scales."""
    if cfg.rope_scaling != "none":
        raise UserError(f"cannot export: model.rope_scaling={cfg.rope_scaling}: Qwen3 takes no such scaling")
    out = llama.tensors(cfg, QWEN3_MOE)
    for path, t in list(out.items()):
        if path.endswith("/attn/wq_DNH"):
            stack = path.split("/")[0]
            for ours, hf in (("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight")):
                layer = t.name  # the layer's q_proj name, from our layer index
                out[f"{stack}/attn/{ours}/scale_H"] = HFTensor(
                    lambda i, layer=layer, hf=hf: layer(i).replace("self_attn.q_proj.weight", hf), 1
                )
    return out


ADAPTER = HFAdapter(
    architectures=ARCHITECTURES,
    model_fields=model_fields,
    export_architecture=export_architecture,
    hf_config=hf_config,
    tensors=tensors,
    unmapped=llama.unmapped,
)
