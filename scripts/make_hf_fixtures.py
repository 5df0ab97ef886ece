"""Build the Hugging Face fixtures under tests/fixtures/hf/ (run once, offline; the tests need
neither torch nor transformers).

Each fixture is a small random model saved by `transformers`' own `save_pretrained`, with the
logits it computes for a fixed token batch and its greedy continuation of a prompt
(`reference.npz`), so the import tests compare against transformers' numbers, not ours.

This machine has a CPU torch wheel only for Python 3.11, so run it in its own venv:

    python3.11 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py [NAME ...]

NAMEs (default: all) rebuild only those fixtures, exactly as a full run would (every model is still
drawn, in order, from the one random stream).

Weights are drawn larger than transformers' init (std 0.1, norm scales 1 +- 0.1, random biases)
so that logits, routing and greedy choices are far from ties.
"""

import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
V, D, L, N, K, F = 128, 32, 2, 4, 2, 64
COMMON = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=F,
    num_hidden_layers=L,
    num_attention_heads=N,
    num_key_value_heads=K,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
FIXTURES = {
    # GQA, untied, plain RoPE
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0), {}),
    # Llama 3.x style: llama3 RoPE scaling (with frequencies in the smoothed band), tied
    # embeddings, a head_dim that is not hidden_size / heads
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            head_dim=16,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        {},
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(rope_theta=1e6, sliding_window=None),
        {},
    ),
    # q/k/v biases
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6), {}),
    # sharded into several files with an index
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None),
        dict(max_shard_size="100KB"),
    ),
    # learned positions, LayerNorm with biases, fused q/k/v (Conv1D, stored (in, out)), tied head
    "gpt2": (
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        dict(
            vocab_size=V,
            n_positions=64,
            n_embd=D,
            n_layer=L,
            n_head=N,
            n_inner=F,
            bos_token_id=1,
            eos_token_id=2,
        ),
        {},
    ),
    # q/k RMSNorm per head, tied embeddings, head_dim not hidden_size / heads
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(head_dim=16, rope_theta=1e6, tie_word_embeddings=True),
        {},
    ),
    # layer 0 dense, layer 1 a mixture of 4 experts (top-2, weights renormalised)
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            head_dim=16,
            rope_theta=1e6,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        ),
        {},
    ),
}
COMMON_FREE = ("gpt2",)  # configs of their own (GPT-2's keys are not Llama's)


def randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or ".ln_" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def tokenizer() -> Tokenizer:
    """A real (word-level) tokenizer of V ids, so that import has a tokenizer.json to copy."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def main(only: list[str]) -> None:
    unknown = sorted(set(only) - set(FIXTURES))
    if unknown:
        raise SystemExit(f"unknown fixture {unknown[0]!r}; fixtures are {', '.join(FIXTURES)}")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (2, 16), generator=gen)
    prompt = torch.randint(0, V, (2, 6), generator=gen)
    for name, (config_cls, model_cls, extra, save_kwargs) in FIXTURES.items():
        torch.manual_seed(0)
        model = model_cls(
            config_cls(**extra) if name in COMMON_FREE else config_cls(**COMMON, **extra)
        ).eval()
        randomise(model, gen)
        if only and name not in only:
            continue
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, **save_kwargs)
        with torch.no_grad():
            logits = model(tokens).logits.float().numpy()
            greedy = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                pad_token_id=0,
            )[:, prompt.shape[1]:]  # fmt: skip
        np.savez(
            out / "reference.npz", tokens=tokens.numpy(), logits=logits, prompt=prompt.numpy(),
            greedy=greedy.numpy(),
        )  # fmt: skip
        if name == "llama":
            tokenizer().save(str(out / "tokenizer.json"))
        files = sorted(p.name for p in out.iterdir())
        print(f"{name}: {sum(p.stat().st_size for p in out.iterdir()):,} bytes: {', '.join(files)}")
    (OUT / "VERSIONS.json").write_text(
        json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}, indent=2) + "\n"
    )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
