"""The GPT-2 family (`model.family = "gpt2"`): learned positions, LayerNorm with biases, a GELU MLP,
the head tied to the token embedding; Hugging Face `GPT2LMHeadModel` import and export."""

from spmd.core.family import ModelFamily
from spmd.models import decoder
from spmd.models.gpt2 import hf_mapping
from spmd.models.gpt2.model import ADAPTER_TARGETS, GPT2, GPT2Config, figures

FAMILY = ModelFamily(
    name="gpt2",
    config_cls=GPT2Config,
    model_cls=GPT2,
    figures=figures,
    activations=decoder.activations,
    cache_axes=decoder.KVCache.axes,
    empty_cache=decoder.KVCache.empty,
    cache_shardings=decoder.KVCache.shardings,
    # The position table's rows: replicated unless a rules file maps `positions`.
    logical_axes={"positions": None},
    hf=hf_mapping.ADAPTER,
    adapter_targets=ADAPTER_TARGETS,
)
