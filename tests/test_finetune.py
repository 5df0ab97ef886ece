"""docs/finetune.md's recipe, run as written on the chat fixtures (a small Llama saved by
transformers, with a chat template), sizes shrunk and a local benchmark for the Hub's: import,
prepare chat data, evaluate (held-out loss, lm-eval), full SFT under fsdp, evaluate again, sample
with the template, export; then LoRA on the same data, evaluated, sampled and exported merged and as
a peft adapter."""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
from test_chat import conversations
from test_harness import write_tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "finetune.md"
SCRIPTS = {
    "spmd-ckpt": "ckpt",
    "spmd-data": "data",
    "spmd-eval": "eval",
    "spmd-train": "train",
    "spmd-sample": "sample",
}
SHRUNK = {  # the doc's sizes -> the fixture's (each must appear in the doc)
    "--seq-len 2048": "--seq-len 128",
    "train.seq_len=2048": "train.seq_len=128",
    "train.global_batch_size=32": "train.global_batch_size=16",
    "optimizer.learning_rate=2e-5": "optimizer.learning_rate=3e-3",
    "optimizer.learning_rate=2e-4": "optimizer.learning_rate=3e-2",
    "--steps 500": "--steps 150",
    "--mesh fsdp=8": "--mesh fsdp=8 --host-devices 8",
    "--tasks hellaswag,arc_easy --limit 200": "--tasks spmd_arith --include-path tasks",  # offline
}


PREFERENCE_SHRUNK = {
    "--seq-len 2048": "--seq-len 128",
    "train.seq_len=2048": "train.seq_len=128",
    "train.global_batch_size=32": "train.global_batch_size=16",
    "optimizer.learning_rate=5e-7": "optimizer.learning_rate=2e-3",
    "optimizer.learning_rate=5e-6": "optimizer.learning_rate=1e-2",
    "--steps 300": "--steps 30",
    "--mesh fsdp=8": "--mesh fsdp=8 --host-devices 8",
}


def recipe(section: str = "The recipe", shrunk: dict = SHRUNK) -> list[list[str]]:
    text = PAGE.read_text()
    block = re.search(rf"## {section}.*?```bash\n(.*?)```", text, re.S).group(1)
    for doc, test in shrunk.items():
        assert doc in block, f"docs/finetune.md no longer says {doc!r}: update the sizes the test shrinks"
        block = block.replace(doc, test)
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def preference_pairs(n: int, seed: int = 1) -> list[dict]:
    """Arithmetic questions, the answer in the trained format preferred to a refusal."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        out.append({
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}."}],
            "rejected": [{"role": "assistant", "content": "I do not know."}],
        })  # fmt: skip
    return out


def test_the_recipe_runs_as_written(tmp_path):
    model = tmp_path / "models" / "Llama-3.2-1B-Instruct"
    shutil.copytree(ROOT / "tests" / "fixtures" / "chat" / "llama-chat", model)
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(c) for c in conversations(600)) + "\n")
    write_tasks(tmp_path)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in preference_pairs(300)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))

    def run_all(commands):
        outputs = []
        for argv in commands:
            done = subprocess.run(
                [sys.executable, "-m", f"spmd.cli.{SCRIPTS[argv[0]]}", *argv[1:]], cwd=tmp_path, env=env,
                capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stderr[-3000:]}"
            outputs.append(done)
        return outputs

    outputs = run_all(recipe())

    def loss(done):
        return float(re.search(r"loss (\d+\.\d+) nats/token", done.stdout + done.stderr).group(1))

    def tokens(done):
        return re.search(r"\(([\d,]+) held-out tokens in \d+ batches of 16 x 128 tokens", done.stdout).group(
            1
        )

    before, after = loss(outputs[2]), loss(outputs[5])
    assert tokens(outputs[2]) == tokens(outputs[5])  # before and after score the same tokens
    print(f"held-out loss before {before}, after {after}; reply {outputs[7].stdout.strip()!r}")
    assert after < 0.5 * before, (before, after)
    assert "trained on assistant" in outputs[1].stderr and "0 dropped" in outputs[1].stderr
    records = [
        json.loads(line) for line in (tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(0 < r["trained_tokens"] < 16 * 128 for r in records)
    lora_after = loss(outputs[10])  # LoRA: the base frozen, adapters of rank 16
    print(f"LoRA: held-out loss {lora_after}")
    assert lora_after < before - 0.2, (before, lora_after)
    assert (tmp_path / "hf" / "lora-merged" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "lora-adapter" / "adapter_model.safetensors").is_file()
    for benchmark in (outputs[3], outputs[6], outputs[11]):  # lm-eval's table: before, after, LoRA
        assert re.search(r"\|spmd_arith *\|.*\|acc *\|", benchmark.stdout), benchmark.stdout
    reply = outputs[7].stdout.strip()
    assert re.fullmatch(r"\d+ \+ \d+ = \d+\.", reply), reply  # the trained format, ended at <|eot_id|>
    exported = tmp_path / "hf" / "sft"
    assert (exported / "chat_template.jinja").read_text() == (model / "chat_template.jinja").read_text()
    assert (exported / "model.safetensors").is_file()

    # Preference tuning after SFT: DPO, then LoRA-DPO, each evaluated on its held-out pairs
    steps = run_all(recipe("Preference tuning", PREFERENCE_SHRUNK))

    def scored(done):
        found = re.search(r"reward accuracy (\d\.\d+), reward margin (-?\d+\.\d+)", done.stdout)
        return float(found.group(1)), float(found.group(2))

    dpo, lora_dpo = scored(steps[2]), scored(steps[6])
    print(f"DPO: held-out reward accuracy {dpo[0]}, margin {dpo[1]}; LoRA-DPO {lora_dpo}; reply "
          f"{steps[3].stdout.strip()!r}")  # fmt: skip
    assert dpo[0] >= 0.9 and dpo[1] > 0.5, dpo
    assert lora_dpo[0] >= 0.9 and lora_dpo[1] > 0.5, lora_dpo
    reply = steps[3].stdout.strip()
    assert reply and "know" not in reply and re.search(r"\d", reply), reply  # not the rejected answer
    assert (tmp_path / "hf" / "dpo" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "dpo-adapter" / "adapter_model.safetensors").is_file()
