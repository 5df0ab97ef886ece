"""Build tests/fixtures/chat/: a small byte-level BPE tokenizer with three chat templates, and what
`transformers` renders and tokenizes for a few conversations (`reference.json`), so the chat-data
tests compare against transformers' own apply_chat_template (the tests need no transformers).

Variants (each a directory with tokenizer.json and tokenizer_config.json):
  llama3      Llama 3's template (BOS from bos_token, <|eot_id|> after each turn)
  chatml      Qwen2.5's ChatML template (a default system turn, <|im_end|>\\n after each turn)
  generation  llama3 with {% generation %} around the assistant text, so transformers also returns
              its assistant-token mask (return_assistant_tokens_mask) to compare ours with
  llama-chat  a small random Llama (vocab 400) saved by transformers with the llama3 tokenizer: the
              checkpoint docs/finetune.md's recipe starts from in tests

This machine has transformers only in a Python 3.11 venv:

    .venv-torch/bin/python scripts/make_chat_fixtures.py
"""

import json
import pathlib
import shutil

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat"
SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHATML = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and messages[0]['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
GENERATION = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
VARIANTS = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|end_of_text|>"}),
    "generation": (GENERATION, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "  Name a prime number.  "},
        {"role": "assistant", "content": "Seven is prime."},
        {"role": "user", "content": "And an even one?"},
        {"role": "assistant", "content": "Two: the only even prime."},
    ],
    [
        {"role": "user", "content": "Wie spät ist es in Tōkyō? 東京"},
        {"role": "assistant", "content": "I cannot tell the time, désolé."},
        {"role": "tool", "content": '{"time": "12:00"}'},
        {"role": "assistant", "content": "The tool says 12:00."},
    ],
]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a prime number has exactly two divisors; seven is prime and two is the only even prime",
    "you are a helpful assistant. answer in one short sentence.",
    "what is the time in tokyo? the tool says twelve o'clock.",
    "user assistant system tool content role",
] * 20


def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    tok = tokenizer()
    reference = {"conversations": CONVERSATIONS, "variants": {}}
    for name, (template, special) in VARIANTS.items():
        d = OUT / name
        d.mkdir(parents=True)
        tok.save(str(d / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **special}
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        hf = transformers.AutoTokenizer.from_pretrained(str(d))
        out = []
        for conversation in CONVERSATIONS:
            text = hf.apply_chat_template(conversation, tokenize=False)
            encoded = hf.apply_chat_template(
                conversation,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=name == "generation",
            )
            record = {"text": text, "ids": list(encoded["input_ids"])}
            if name == "generation":
                record["assistant_masks"] = list(encoded["assistant_masks"])
            out.append(record)
        reference["variants"][name] = out
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1, ensure_ascii=False))
    model_dir = OUT / "llama-chat"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=0, eos_token_id=4, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(str(model_dir))
    transformers.AutoTokenizer.from_pretrained(str(OUT / "llama3")).save_pretrained(str(model_dir))
    print(f"wrote {OUT} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
