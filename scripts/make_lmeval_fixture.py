"""Build tests/fixtures/chat/loglikelihood.json: what `transformers` computes, in float32, on the
llama-chat fixture for the requests lm-eval makes (the same encoding as its `hf` model: the pair
encoded whole without special tokens and split after the context's tokens), so the `spmd` lm-eval
adapter is compared with transformers' numbers, not its own.

    .venv-torch/bin/python scripts/make_lmeval_fixture.py
"""

import json
import pathlib

import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat"
PAIRS = [
    ("What is 2 + 2?", " 4"),
    ("What is 2 + 2?", " 5"),
    ("The quick brown fox", " jumps over the lazy dog"),
    ("a prime number has exactly two divisors;", " seven is prime"),
    ("Tōkyō 東京", " time"),
    ("The quick brown fox", " time"),
    ("a prime number has exactly two divisors;", " 4"),
]
ROLLING = ["you are a helpful assistant. answer in one short sentence.", "the tool says twelve o'clock."]


def main() -> None:
    directory = ROOT / "llama-chat"
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    prefix = tok.eos_token_id

    def score(context_ids, continuation_ids):
        whole = torch.tensor([context_ids + continuation_ids])
        with torch.no_grad():
            logits = model(whole[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, -1)[0, -len(continuation_ids) :]
        target = torch.tensor(continuation_ids)
        picked = logp.gather(-1, target[:, None])[:, 0]
        return float(picked.sum()), bool((logp.argmax(-1) == target).all())

    records = []
    for context, continuation in PAIRS:
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        n = len(tok(context, add_special_tokens=False).input_ids)
        logprob, greedy = score(whole[:n], whole[n:])
        records.append(
            {"context": context, "continuation": continuation, "logprob": logprob, "greedy": greedy}
        )
    rolling = []
    for text in ROLLING:  # shorter than the context: one window, conditioned on the prefix token
        ids = tok(text, add_special_tokens=False).input_ids
        rolling.append({"text": text, "logprob": score([prefix], ids)[0]})
    out = {"prefix_token_id": prefix, "loglikelihood": records, "rolling": rolling}
    (ROOT / "loglikelihood.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {ROOT / 'loglikelihood.json'} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
