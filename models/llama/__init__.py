"""The Llama family (`model.family = "llama"`, the default): Llama 2/3/3.1+, Mistral, Qwen2 and
Mixtral, dense or a mixture of experts ([moe]); Hugging Face import and export."""

from spmd.models import decoder
from spmd.models.llama import hf_mapping
from spmd.models.llama.model import (
    ADAPTER_TARGETS,
    Llama,
    LlamaConfig,
    count_params,
    figures,
    flops_per_token,
)

__all__ = ["FAMILY", "Llama", "LlamaConfig", "count_params", "figures", "flops_per_token"]

FAMILY = decoder.family(
    "llama", LlamaConfig, Llama, figures, hf=hf_mapping.ADAPTER, adapter_targets=ADAPTER_TARGETS, mixture=True
)
