"""The Qwen3 family (`model.family = "qwen3"`): the Llama decoder with per-head q/k RMSNorm, dense or
a mixture of experts ([moe]); Hugging Face `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` import and
export."""

from spmd.core.family import ModelFamily
from spmd.models import decoder, moe
from spmd.models.llama.model import ADAPTER_TARGETS
from spmd.models.qwen3 import hf_mapping
from spmd.models.qwen3.model import Qwen3, Qwen3Config, figures

FAMILY = ModelFamily(
    name="qwen3",
    config_cls=Qwen3Config,
    model_cls=Qwen3,
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
