"""The Llama family (`model.family = "llama"`, the default): Llama 2/3/3.1+, Mistral, Qwen2 and
Mixtral, dense or a mixture of experts ([moe]); Hugging Face import and export."""

from spmd.core.family import ModelFamily
from spmd.models import decoder, moe
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

FAMILY = ModelFamily(
    name="llama",
    config_cls=LlamaConfig,
    model_cls=Llama,
    figures=figures,
    activations=decoder.activations,
    cache_axes=decoder.KVCache.axes,
    empty_cache=decoder.KVCache.empty,
    cache_shardings=decoder.KVCache.shardings,
    aux_weights=moe.aux_weights,
    aux_metrics=moe.aux_metrics,
    hf=hf_mapping.ADAPTER,
    adapter_targets=ADAPTER_TARGETS,
)
