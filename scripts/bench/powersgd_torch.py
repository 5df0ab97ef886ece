"""PyTorch's side of scripts/bench/bench_sync.py: DDP over gloo with PyTorch's PowerSGD hook.

Runs in its own Python 3.11 venv with the CPU torch wheel and transformers (never in the
project's dependencies):
    .venv-torch/bin/python scripts/bench/powersgd_torch.py init --config JSON --out DIR
    .venv-torch/bin/python scripts/bench/powersgd_torch.py train --spec JSON

`init` writes a seeded LlamaForCausalLM of the given sizes as an HF directory (ours imports it, so
both sides start from the same weights). `train` runs `world` processes of DDP on loopback, one
core each, on the batches in the spec's .npz (inputs and targets per step, every rank its rows),
AdamW with our warmup + cosine schedule and global-norm clipping, and a comm hook: PyTorch's
all-reduce or `powerSGD_hook` (its error feedback and warm start, `start_powerSGD_iter`). It
prints one JSON line: the loss per step (the mean over all rows), the bytes each process sent to
all-reduces per step (counted in torch.distributed.all_reduce) and the step time.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def init(config: dict, out: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.save_pretrained(out, safe_serialization=True)


def lr_at(step: int, s: dict) -> float:
    """optax.warmup_cosine_decay_schedule as spmd.training.optimizer.lr_schedule makes it."""
    peak, warmup, decay = s["lr"], s["warmup"], max(s["steps"], s["warmup"] + 1)
    if step < warmup:
        return peak * step / warmup
    t = min(step - warmup, decay - warmup) / (decay - warmup)
    end = peak * s["min_lr_ratio"]
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


def worker(rank: int, s: dict, out_path: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{s['port']}", rank=rank, world_size=s["world"]
    )
    sent = [0]
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted  # the hooks call torch.distributed.all_reduce by attribute
    model = LlamaForCausalLM.from_pretrained(s["init"], torch_dtype=torch.float32)
    model.config.use_cache = False
    ddp = DistributedDataParallel(model)
    if s["compress"] == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=s["rank"], start_powerSGD_iter=s["start_step"],
            use_error_feedback=True, warm_start=True, random_seed=0,
        )  # fmt: skip
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s["lr"], betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    data = np.load(s["batches"])
    inputs, targets = data["inputs"], data["targets"]
    rows = inputs.shape[1] // s["world"]
    losses, times = [], []
    for step in range(s["steps"]):
        x = torch.from_numpy(inputs[step, rank * rows : (rank + 1) * rows].astype(np.int64))
        y = torch.from_numpy(targets[step, rank * rows : (rank + 1) * rows].astype(np.int64))
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        logits = ddp(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        mean = loss.detach().clone()
        all_reduce(mean)  # not counted: the logged loss, not the sync
        times.append(time.perf_counter() - t0)
        losses.append(float(mean) / s["world"])
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"loss": losses, "bytes_per_step": sent[0] / s["steps"], "step_s": float(np.median(times)),
                       "torch": torch.__version__}, f)  # fmt: skip
    # No destroy_process_group: under gloo it waited on the other rank now and then; exiting frees it.


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["init", "train"])
    p.add_argument("--config", help="init: LlamaConfig keyword arguments as JSON")
    p.add_argument("--out", help="init: the HF directory to write")
    p.add_argument("--spec", help="train: JSON (see worker)")
    args = p.parse_args()
    if args.what == "init":
        init(json.loads(args.config), args.out)
        return
    s = json.loads(args.spec)
    out = s["out"]
    mp.spawn(worker, args=(s, out), nprocs=s["world"], join=True)
    with open(out) as f:
        print(json.dumps(json.load(f)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
