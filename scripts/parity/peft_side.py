"""peft's logits for a LoRA adapter exported by `spmd-ckpt export-hf --adapter` on the base model it
was trained on (a Hugging Face directory). Run it with a Python that has torch, transformers and
peft beside the project (never inside it), e.g. .venv-torch:

    .venv-torch/bin/python scripts/parity/peft_side.py BASE_DIR ADAPTER_DIR TOKENS.npy OUT.npy

TOKENS.npy: (B, T) token ids; OUT.npy gets peft's (B, T, V) float32 logits.
"""

import sys

import numpy as np


def main(base_dir: str, adapter_dir: str, tokens: str, out: str) -> None:
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(np.load(tokens).astype(np.int64))).logits
    np.save(out, logits.float().numpy())


if __name__ == "__main__":
    main(*sys.argv[1:5])
