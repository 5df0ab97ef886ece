"""The GPT-2 family's Hugging Face mapping: `GPT2LMHeadModel` as `transformers` saves it.

GPT-2's projections are Conv1D, stored (in, out) as ours are, so nothing is transposed; its
q, k and v are one fused `c_attn` (D, 3D), whose thirds are our three projections (and its bias's
thirds their biases). The head is the token embedding (tied), as HF's is.
"""

from spmd.core.errors import UserError
from spmd.core.family import HFAdapter, HFTensor
from spmd.models.gpt2.model import GPT2Config

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2"}
# A causal-mask buffer some older checkpoints saved with each layer; recomputed, never a parameter.
BUFFERS = (".attn.bias", ".attn.masked_bias")


def model_fields(hf: dict, source: str) -> dict:
    """Our GPT2Config fields for an HF config.json, or an error naming what we cannot express."""

    def need(key):
        if key not in hf:
            raise UserError(f"{source}: config.json has no {key!r}, which GPT2LMHeadModel needs")
        return hf[key]

    def refuse(what: str):
        raise UserError(f"{source}: {what} is not supported by this model; it cannot be imported faithfully")

    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        refuse(f"activation_function={hf['activation_function']!r} (only gelu_new, GELU's tanh form)")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        refuse("attention scaled other than by 1/sqrt(head_dim)")
    if hf.get("add_cross_attention"):
        refuse("cross-attention")
    if not hf.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings=false (GPT-2's head is its token embedding)")
    D = int(need("n_embd"))
    return dict(
        vocab_size=int(need("vocab_size")),
        max_positions=int(need("n_positions")),
        d_model=D,
        n_layers=int(need("n_layer")),
        n_heads=int(need("n_head")),
        d_ff=int(hf.get("n_inner") or 4 * D),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def export_architecture(cfg: GPT2Config, base: dict | None) -> str:
    return "GPT2LMHeadModel"


def hf_config(cfg: GPT2Config, arch: str, base: dict | None, max_positions: int, dtype: str) -> dict:
    """config.json for `cfg`: the imported config (when there was one) with every field we map
    rewritten from `cfg`."""
    out = dict(base or {})
    out.update(
        architectures=[arch],
        model_type="gpt2",
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_positions,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.d_ff,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        initializer_range=cfg.init_std,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        tie_word_embeddings=True,
    )
    out["torch_dtype" if "dtype" not in out else "dtype"] = dtype
    return out


def tensors(cfg: GPT2Config) -> dict[str, HFTensor]:
    """Our parameter path -> its HF tensor (a third of the fused c_attn for q, k and v)."""

    def layer(suffix):
        return lambda i: f"transformer.h.{i}.{suffix}"

    out = {
        "wte_VD": HFTensor(lambda: "transformer.wte.weight"),
        "wpe_PD": HFTensor(lambda: "transformer.wpe.weight"),
        "ln_f/scale_D": HFTensor(lambda: "transformer.ln_f.weight"),
        "ln_f/bias_D": HFTensor(lambda: "transformer.ln_f.bias"),
    }
    for ours, hf in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
        out[f"layers/{ours}/scale_D"] = HFTensor(layer(f"{hf}.weight"), 1)
        out[f"layers/{ours}/bias_D"] = HFTensor(layer(f"{hf}.bias"), 1)
    for i, w in enumerate(("q", "k", "v")):
        out[f"layers/attn/w{w}_DNH"] = HFTensor(
            layer("attn.c_attn.weight"), 1, groups=((0,), (1, 2)), part=(1, i, 3)
        )
        out[f"layers/attn/b{w}_NH"] = HFTensor(layer("attn.c_attn.bias"), 1, groups=((0, 1),), part=(0, i, 3))
    out.update(
        {
            "layers/attn/wo_NHD": HFTensor(layer("attn.c_proj.weight"), 1, groups=((0, 1), (2,))),
            "layers/attn/bo_D": HFTensor(layer("attn.c_proj.bias"), 1),
            "layers/mlp/w_fc_DF": HFTensor(layer("mlp.c_fc.weight"), 1),
            "layers/mlp/b_fc_F": HFTensor(layer("mlp.c_fc.bias"), 1),
            "layers/mlp/w_proj_FD": HFTensor(layer("mlp.c_proj.weight"), 1),
            "layers/mlp/b_proj_D": HFTensor(layer("mlp.c_proj.bias"), 1),
        }
    )
    return out


def unmapped(cfg: GPT2Config, name: str) -> bool:
    """The causal-mask buffers of older checkpoints, and the head stored beside the table it is."""
    return name.endswith(BUFFERS) or name == "lm_head.weight"


ADAPTER = HFAdapter(
    architectures=ARCHITECTURES,
    model_fields=model_fields,
    export_architecture=export_architecture,
    hf_config=hf_config,
    tensors=tensors,
    unmapped=unmapped,
)
