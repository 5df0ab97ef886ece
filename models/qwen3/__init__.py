"""The Qwen3 family (`model.family = "qwen3"`): the Llama decoder with per-head q/k RMSNorm, dense or
a mixture of experts ([moe]); Hugging Face `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` import and
export."""

from spmd.models import decoder
from spmd.models.llama.model import ADAPTER_TARGETS
from spmd.models.qwen3 import hf_mapping
from spmd.models.qwen3.model import Qwen3, Qwen3Config, figures

FAMILY = decoder.family(
    "qwen3", Qwen3Config, Qwen3, figures, hf=hf_mapping.ADAPTER, adapter_targets=ADAPTER_TARGETS, mixture=True
)
