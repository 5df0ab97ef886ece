"""TRL's numbers for preference tuning, as a golden file tests/test_preference.py compares against.

Runs TRL's DPOTrainer (loss types sigmoid, ipo, hinge, robust), CPOTrainer(loss_type="simpo",
cpo_alpha=0: SimPO alone) and ORPOTrainer on the fixture model tests/fixtures/chat/llama-chat
(a transformers Llama, fp32) and the preference rows in tests/fixtures/preference/pairs.jsonl:
one batch of every pair per step, plain SGD at a constant learning rate, no clipping. It records
each step's logged loss and metrics, and the token ids TRL's DPOTrainer makes of each row (string
and conversational rows), which spmd-data prepare --format preference must reproduce.

Beside TRL's own run, each case is also run as plain PyTorch autograd of TRL's formulas on the
DPOTrainer's token ids (`exact_steps`): TRL's DPOTrainer differentiates through its fused LM head,
whose gradient differs from autograd's by about 0.1% (cosine 0.99998, norm 0.998 on this model),
so its trajectory leaves the exact one after the first update; and CPOTrainer/ORPOTrainer tokenize
with a BOS that DPOTrainer's tokenization has not. `trl_vs_exact` is the largest difference of
TRL's logged numbers from the same autograd run on TRL's own tokens, per case.

Run it with a Python that has torch, transformers and trl beside the project (never inside it):

    .venv-torch/bin/python scripts/parity/trl_preference.py tests/golden/trl_preference.json
"""

import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests/fixtures/chat/llama-chat"
PAIRS = ROOT / "tests/fixtures/preference/pairs.jsonl"
CONVERSATIONS = ROOT / "tests/fixtures/preference/conversations.jsonl"
STEPS, LR, BETA = 3, 0.5, 0.1
CASES = {  # name -> (trainer, its config's settings)
    "dpo_sigmoid": ("dpo", {"loss_type": "sigmoid"}),
    "dpo_ipo": ("dpo", {"loss_type": "ipo"}),
    "dpo_hinge": ("dpo", {"loss_type": "hinge"}),
    "dpo_robust": ("dpo", {"loss_type": "robust", "label_smoothing": 0.1}),
    "simpo": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5}),
    "orpo": ("orpo", {}),
}
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")  # fmt: skip


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(kind: str, settings: dict, out_dir: str):
    import datasets
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    if kind != "dpo":  # their collators pad with it (DPOTrainer picks the same)
        tokenizer.pad_token = tokenizer.eos_token
    data = datasets.Dataset.from_list(rows(PAIRS))
    common = dict(
        output_dir=out_dir, per_device_train_batch_size=len(data), max_steps=STEPS, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, beta=BETA,
        dataloader_drop_last=False,
    )  # fmt: skip
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, max_length=None, **settings)
        trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    elif kind == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(**common, max_length=None, **settings)
        trainer = CPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(**common, max_length=None, **settings)
        trainer = ORPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    steps = [{k.removeprefix("train_"): float(v) for k, v in entry.items()
              if k.removeprefix("train_") in METRICS} for entry in logged]  # fmt: skip
    return steps, trainer


def exact(kind: str, settings: dict, sequences):
    """The case's three SGD steps as plain autograd of TRL's formulas: a list of per-step metrics.
    `sequences`: per pair, (chosen ids, rejected ids, completion start)."""
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    rows = [c for c, _, _ in sequences] + [r for _, r, _ in sequences]
    starts = [s for _, _, s in sequences] * 2
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    real = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    completion = torch.tensor(
        [[0] * s + [1] * (len(r) - s) + [0] * (T - len(r)) for r, s in zip(rows, starts)]
    )
    beta, eps = BETA, settings.get("label_smoothing", 0.0)

    def forward():
        logits = model(input_ids=ids, attention_mask=real).logits[:, :-1]
        per_token = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask, every = completion[:, 1:].float(), real[:, 1:].float()
        return (per_token * mask).sum(1), mask.sum(1), -(per_token * every).sum(1), every.sum(1)

    with torch.no_grad():
        ref = forward()[0]
    steps = []
    for _ in range(STEPS):
        model.zero_grad()
        logps, n, nll, n_all = forward()
        c, r = logps.chunk(2)
        n_c, n_r = n.chunk(2)
        c_avg, r_avg = c / n_c, r / n_r
        metrics = {}
        if kind == "dpo":
            c0, r0 = ref.chunk(2)
            d = (c - c0) - (r - r0)
            loss = {
                "sigmoid": lambda: -F.logsigmoid(beta * d),
                "ipo": lambda: ((c - c0) / n_c - (r - r0) / n_r - 1 / (2 * beta)) ** 2,
                "hinge": lambda: torch.relu(1 - beta * d),
                "robust": lambda: (
                    (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
                ),
            }[settings["loss_type"]]().mean()
            chosen, rejected, shown = beta * (c - c0), beta * (r - r0), (c, r)
        elif kind == "cpo":  # simpo, cpo_alpha = 0
            z = c_avg - r_avg - settings["simpo_gamma"] / beta
            loss = (-F.logsigmoid(beta * z) * (1 - eps) - F.logsigmoid(-beta * z) * eps).mean()
            chosen, rejected, shown = beta * c_avg, beta * r_avg, (c_avg, r_avg)
        else:  # orpo: NLL over every real token of the chosen sequences
            log_odds = (c_avg - r_avg) - (torch.log1p(-torch.exp(c_avg)) - torch.log1p(-torch.exp(r_avg)))
            ratio = F.logsigmoid(log_odds)
            nll_loss = nll.chunk(2)[0].sum() / n_all.chunk(2)[0].sum()
            loss = nll_loss - (beta * ratio).mean()
            chosen, rejected, shown = beta * c_avg, beta * r_avg, (c_avg, r_avg)
            metrics = {
                "nll_loss": nll_loss,
                "log_odds_ratio": ratio.mean(),
                "log_odds_chosen": log_odds.mean(),
            }
        metrics.update({
            "loss": loss, "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean(),
            "logps/chosen": shown[0].mean(), "logps/rejected": shown[1].mean(),
        })  # fmt: skip
        steps.append({k: float(v) for k, v in metrics.items()})
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return steps


def own_sequences(trainer) -> list:
    """(chosen ids, rejected ids, completion start) per pair as a CPO/ORPO trainer tokenized them."""
    out = []
    for row in trainer.train_dataset:
        start = sum(1 for label in row["chosen_labels"] if label == -100)
        out.append((list(row["chosen_input_ids"]), list(row["rejected_input_ids"]), start))
    return out


def dpo_ids(path) -> list[dict]:
    """The token ids DPOTrainer makes of each row of `path` (prompt, chosen, rejected)."""
    import datasets
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    data = datasets.Dataset.from_list(rows(path))
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, report_to=[], use_cpu=True, max_length=None)
        trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    return [{k: list(map(int, r[k])) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
            for r in trainer.train_dataset]  # fmt: skip


def main(out: str) -> None:
    import torch
    import transformers
    import trl

    golden = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "settings": {
            "steps": STEPS,
            "learning_rate": LR,
            "beta": BETA,
            "pairs_per_step": len(rows(PAIRS)),
            "optimizer": "sgd, constant learning rate, no clipping, no weight decay, fp32",
        },  # fmt: skip
        "cases": {},
        "tokens": {"pairs.jsonl": dpo_ids(PAIRS), "conversations.jsonl": dpo_ids(CONVERSATIONS)},
    }
    dpo_sequences = [(r["prompt_ids"] + r["chosen_ids"], r["prompt_ids"] + r["rejected_ids"], len(r["prompt_ids"]))
                     for r in golden["tokens"]["pairs.jsonl"]]  # fmt: skip
    for name, (kind, settings) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            steps, trainer = run(kind, settings, tmp)
        own = dpo_sequences if kind == "dpo" else own_sequences(trainer)
        on_own = exact(kind, settings, own)
        worst = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(steps, on_own) for k in a
                    if k in b and not (kind == "cpo" and k == "nll_loss"))  # fmt: skip
        golden["cases"][name] = {
            "trainer": kind, "settings": settings, "steps": steps,
            "exact_steps": on_own if kind == "dpo" else exact(kind, settings, dpo_sequences),
            "trl_vs_exact": {"first_step": max(abs(v - on_own[0][k]) / max(1.0, abs(on_own[0][k]))
                                               for k, v in steps[0].items() if k in on_own[0]
                                               and not (kind == "cpo" and k == "nll_loss")),
                             "all_steps": worst},
        }  # fmt: skip
        print(name, golden["cases"][name]["trl_vs_exact"], file=sys.stderr)
    pathlib.Path(out).write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
