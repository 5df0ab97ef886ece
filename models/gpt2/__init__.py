"""The GPT-2 family (`model.family = "gpt2"`): learned positions, LayerNorm with biases, a GELU MLP,
the head tied to the token embedding; Hugging Face `GPT2LMHeadModel` import and export."""

from spmd.models import decoder
from spmd.models.gpt2 import hf_mapping
from spmd.models.gpt2.model import ADAPTER_TARGETS, GPT2, GPT2Config, figures

FAMILY = decoder.family(
    "gpt2", GPT2Config, GPT2, figures, hf=hf_mapping.ADAPTER, adapter_targets=ADAPTER_TARGETS,
    # The position table's rows: replicated unless a rules file maps `positions`.
    logical_axes={"positions": None},
)  # fmt: skip
