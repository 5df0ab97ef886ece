"""What crosses between slices ([sync], spmd/parallel/slices.py): side by side with PyTorch's
PowerSGD, and convergence at equal tokens. Two slices simulated on 2 CPU devices (sync.axes =
data); what each process would send is read from the compiled step's collectives over `data`.

    python scripts/bench/bench_sync.py torch [--steps 300] [--ranks 1,4] [--torch-python .venv-torch/bin/python]
    python scripts/bench/bench_sync.py convergence [--steps 600]

torch: one model (`small`'s sizes, float32), one set of starting weights (a seeded
LlamaForCausalLM that ours imports), the same batches (ours, dumped for PyTorch), AdamW with the
same schedule and clipping, two data-parallel workers: ours with sync.compress = none | powersgd
(rank r, start_step 2) against DDP over gloo with PyTorch's all-reduce or `powerSGD_hook` (its
error feedback and warm start, start_powerSGD_iter 2) in scripts/bench/powersgd_torch.py (PyTorch's
own 3.11 venv). Reports the loss at steps 50, 100, 200, ..., the largest gap between the curves
(a 20-step moving average, after step 20), the bytes handed to collectives per step by each
process (PyTorch: counted in torch.distributed.all_reduce; ours: all-reduce operands and
all-gather inputs over `data` in the compiled step) and the median step time.

convergence: `small` on its byte corpus, 2 slices, held-out loss after the same tokens for
allreduce, int8, PowerSGD rank 1 and 4, DiLoCo H 8 and 32, streaming DiLoCo (H 32, 4 fragments),
and the bytes each sends over the slow axis per step (DiLoCo's amortised over its syncs).
"""

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from spmd.analysis import hlo  # noqa: E402
from spmd.assembly.config import config_from_json, load_config  # noqa: E402
from spmd.assembly.setup import assemble  # noqa: E402
from spmd.io import checkpoint as ckpt  # noqa: E402
from spmd.io import hf  # noqa: E402
from spmd.training.trainer import evaluate  # noqa: E402

SIM = ["sync.axes=data"]


def crossing_bytes(setup) -> dict:
    """Bytes each device hands to collectives over `data` per step, as PyTorch's count reads a
    tensor handed to all_reduce: an all-reduce's operand, an all-gather's input. Collectives in a
    conditional (DiLoCo's sync) come per sync, under "per_sync"."""
    trainer = setup.trainer
    B, T = setup.cfg.train.global_batch_size, setup.cfg.train.seq_len
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch(B, T)).compile().as_text()
    n = setup.mesh.shape["data"]

    def payload(items):
        return sum(
            c.bytes * c.count // (n if c.kind == "all-gather" else 1) for c in items if c.axes == ("data",)
        )

    every = payload(hlo.collectives(text, setup.mesh))
    everything = payload(hlo.collectives(text, setup.mesh, all_branches=True))
    return {"per_step": every, "per_sync": everything - every}


def run(setup, state, steps: int, batches=None, timed=True):
    trainer = setup.trainer
    batches = batches or setup.batches()
    losses, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        state, m = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(m["loss"]))
        times.append(time.perf_counter() - t0)
    return state, losses, float(np.median(times[2:])) if timed else None


def smooth(x, k=20):
    return np.convolve(np.asarray(x), np.ones(k) / k, mode="valid")


# --- side by side with PyTorch -------------------------------------------------------------------

HF_CONFIG = {  # `small`'s model, float32
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 128,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32",
}  # fmt: skip
TRAIN = {"lr": 2e-3, "warmup": 30, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def side_by_side(args) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-sync-"))
    torch_py = str(ROOT / args.torch_python)
    script = str(ROOT / "scripts/bench/powersgd_torch.py")
    subprocess.run(
        [torch_py, script, "init", "--config", json.dumps(HF_CONFIG), "--out", str(tmp / "hf")], check=True
    )
    hf.import_hf(
        str(tmp / "hf"), str(tmp / "run"), mesh="fsdp=2", rules="fsdp", overrides=["train.seq_len=128"]
    )
    directory, step = ckpt.locate(str(tmp / "run"))
    meta = ckpt.read_meta(directory, step)
    train = [
        f"train.steps={args.steps}", "train.global_batch_size=16", "train.seq_len=128", "train.microbatches=1",
        f"optimizer.learning_rate={TRAIN['lr']}", f"optimizer.warmup_steps={TRAIN['warmup']}",
        f"optimizer.min_lr_ratio={TRAIN['min_lr_ratio']}", f"optimizer.weight_decay={TRAIN['weight_decay']}",
        f"optimizer.grad_clip={TRAIN['grad_clip']}", "model.dtype=float32",
    ]  # fmt: skip
    base = config_from_json(meta["run"]["config"])
    variants = [("allreduce", "none", 0)] + [(f"powersgd r{r}", "powersgd", r) for r in args.ranks]
    rows = []
    batches_file = tmp / "batches.npz"
    for name, compress, rank in variants:
        over = train + (
            []
            if compress == "none"
            else SIM + ["sync.compress=powersgd", f"sync.rank={rank}", "sync.start_step=2"]
        )
        setup = assemble(base, "data=2", "dp", overrides=over)
        batches = setup.batches()
        if not batches_file.exists():
            ins, tgs = zip(
                *(
                    (np.asarray(b["inputs"]), np.asarray(b["targets"]))
                    for b in map(batches.train_batch, range(args.steps))
                )
            )
            np.savez(batches_file, inputs=np.stack(ins), targets=np.stack(tgs))
        params, _ = ckpt.restore_model(directory, step, setup.plan, meta)
        state = setup.trainer.state_from_params(params)
        _, ours, step_s = run(setup, state, args.steps, batches)
        # what a compressed step sends (with start_step the step is a conditional whose first
        # branch, the uncompressed one, is what crossing_bytes counts per step)
        compressed = [o for o in over if not o.startswith("sync.start_step")]
        sent = crossing_bytes(
            setup if compressed == over else assemble(base, "data=2", "dp", overrides=compressed)
        )
        sent = sent["per_step"]
        spec = {
            "world": 2, "port": free_port(), "init": str(tmp / "hf"), "batches": str(batches_file), "steps": args.steps,
            "compress": compress, "rank": rank, "start_step": 2, "out": str(tmp / f"torch-{compress}-{rank}.json"), **TRAIN,
        }  # fmt: skip
        for attempt in range(2):  # a loopback port taken between free_port and gloo's bind: once more
            out = subprocess.run(
                [torch_py, script, "train", "--spec", json.dumps(spec)], capture_output=True, text=True
            )
            if out.returncode == 0:
                break
            print(out.stderr[-3000:], file=sys.stderr)
            spec["port"] = free_port()
        else:
            raise SystemExit(f"PyTorch's {name} run failed twice")
        theirs = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"name": name, "ours": ours, "torch": theirs["loss"], "ours_bytes": sent,
                     "torch_bytes": theirs["bytes_per_step"], "ours_step_s": step_s, "torch_step_s": theirs["step_s"]})  # fmt: skip
        print(f"{name}: ours {ours[-1]:.4f}, torch {theirs['loss'][-1]:.4f}", flush=True)
    plain = rows[0]
    for r in rows:
        r["gap_vs_torch"] = float(np.max(np.abs(smooth(r["ours"])[20:] - smooth(r["torch"])[20:])))
        r["gap_vs_uncompressed"] = float(np.max(np.abs(smooth(r["ours"])[20:] - smooth(plain["ours"])[20:])))
    marks = [s for s in (50, 100, 200, 300, 400, 500) if s <= args.steps]
    print(f"\n| sync | side | {' | '.join(f'loss@{s}' for s in marks)} | bytes/step | step |")
    print(f"|---|---|{'---|' * len(marks)}---|---|")
    for r in rows:
        for side in ("ours", "torch"):
            losses = r[side]
            print(f"| {r['name']} | {side} | {' | '.join(f'{losses[s - 1]:.4f}' for s in marks)} | "
                  f"{r[side + '_bytes'] / 2**10:,.1f} KiB | {r[side + '_step_s'] * 1e3:.0f} ms |")  # fmt: skip
    for r in rows:
        print(f"{r['name']}: largest gap ours vs PyTorch {r['gap_vs_torch']:.4f}, ours vs uncompressed "
              f"{r['gap_vs_uncompressed']:.4f} (20-step averages after step 20)")  # fmt: skip
    return {"torch": rows}


# --- convergence at equal tokens -----------------------------------------------------------------

METHODS = [
    ("allreduce", []),
    ("int8", ["sync.compress=int8"]),
    ("powersgd r1", ["sync.compress=powersgd", "sync.rank=1"]),
    ("powersgd r4", ["sync.compress=powersgd", "sync.rank=4"]),
    ("diloco H8", ["sync.method=diloco", "sync.inner_steps=8"]),
    ("diloco H32", ["sync.method=diloco", "sync.inner_steps=32"]),
    ("streaming H32 F4", ["sync.method=streaming_diloco", "sync.inner_steps=32", "sync.fragments=4"]),
]


def convergence(args) -> dict:
    rows = []
    for name, over in METHODS:
        over = [f"train.steps={args.steps}", *([] if not over else SIM + over)]
        setup = assemble(load_config("small"), "data=2", "dp", overrides=over)
        batches = setup.batches(held_out=True)
        state, losses, step_s = run(setup, setup.trainer.init_state(), args.steps, batches)
        held_out = evaluate(setup.trainer, setup.trainer.model_params(state), batches)
        sent = crossing_bytes(setup)
        H = setup.cfg.sync.inner_steps if setup.cfg.sync.diloco else 1
        per_step = sent["per_step"] + sent["per_sync"] / H  # each fragment syncs once per H steps
        tokens = args.steps * setup.cfg.train.global_batch_size * setup.cfg.train.seq_len
        rows.append({"name": name, "held_out": held_out, "train": float(np.mean(losses[-20:])), "tokens": tokens,
                     "bytes_per_step": per_step, "step_s": step_s})  # fmt: skip
        print(f"{name}: held-out {held_out:.4f}, {per_step / 2**10:,.1f} KiB/step", flush=True)
    ref = rows[0]["bytes_per_step"]
    print(
        "\n| sync | held-out loss | train loss (last 20) | sent over the slow axis per step | vs allreduce | step |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['held_out']:.4f} | {r['train']:.4f} | {r['bytes_per_step'] / 2**10:,.1f} KiB | "
              f"{r['bytes_per_step'] / ref:.3f}x | {r['step_s'] * 1e3:.0f} ms |")  # fmt: skip
    return {"convergence": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["torch", "convergence"])
    p.add_argument("--steps", type=int, default=0, help="[torch: 300, convergence: 600]")
    p.add_argument("--ranks", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4])
    p.add_argument("--torch-python", default=".venv-torch/bin/python")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    assert len(jax.devices()) == 2, "runs on 2 CPU devices (XLA_FLAGS is set above)"
    args.steps = args.steps or (300 if args.what == "torch" else 600)
    result = side_by_side(args) if args.what == "torch" else convergence(args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
