"""PyTorch's side of scripts/bench/bench_vs_torch.py: one benchmark worker per process.

Runs in its own Python 3.11 venv with the CPU torch wheel (never in the project's dependencies):
    .venv-torch/bin/python scripts/bench/torch_side.py --spec '{"kind": "train", ...}'

The worker builds what the spec names, warms it up, prints `@@ {"ready": ...}`, then answers each
`run` line on stdin with `@@ {json}` (the measurement of one window) until `quit`. The orchestrator
alternates windows of ours and PyTorch's, so each side runs while the other waits on stdin.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from bench_torch import Decoder, rope  # same directory: the train-step model of bench_train.py
from bench_vs_torch import peak_rss_bytes, quiet_disk, rss_bytes, say, timed  # stdlib only at import


def model_args(s: dict) -> argparse.Namespace:
    return argparse.Namespace(
        vocab_size=s["vocab_size"],
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        head_dim=s["head_dim"],
        d_ff=s["d_ff"],
        rope_theta=s["rope_theta"],
        tie_embeddings=s.get("tie_embeddings", False),
    )


# ---------------------------------------------------------------- train step (eager / compile)


def train(s: dict):
    """`device` "cuda": the model on the GPU, fused AdamW (PyTorch's fastest there)."""
    torch.manual_seed(0)
    a = model_args(s)
    device = s.get("device", "cpu")
    model = Decoder(a).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda" or None
    )
    bf16 = s["dtype"] == "bfloat16"

    def loss_of(tokens):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, a.vocab_size), tokens[:, 1:].reshape(-1))

    if s["compile"]:  # the model and its loss (forward and, through AOTAutograd, backward)
        loss_of = torch.compile(loss_of)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab_size, (s["batch"], s["seq_len"] + 1), generator=g).to(device)
    last = {}

    def step():
        loss = loss_of(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last["loss"] = loss.item()

    for _ in range(s["warmup"]):
        step()
    return lambda: {"time": timed(step, s["steps"]), "loss": last["loss"]}


# ---------------------------------------------------------------- attention forward + backward


def attention(s: dict):
    g = torch.Generator().manual_seed(0)
    B, T, N, K, H = s["B"], s["T"], s["N"], s["K"], s["H"]
    q = torch.randn(B, N, T, H, generator=g, requires_grad=True)
    k = torch.randn(B, K, T, H, generator=g, requires_grad=True)
    v = torch.randn(B, K, T, H, generator=g, requires_grad=True)
    do = torch.randn(B, N, T, H, generator=g)
    base = rss_bytes()

    def step():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (q, k, v), do)

    step()
    return lambda: {"time": timed(step, s["reps"]), "peak_bytes": peak_rss_bytes() - base}


# ---------------------------------------------------------------- MoE layer forward + backward


def moe(s: dict):
    """A top-k SwiGLU MoE as one would write it in PyTorch: softmax router, top-k, renormalised
    weights; `index_add`: a loop over experts gathering their tokens (Mixtral's HF code);
    `grouped_mm`: token-choices sorted by expert and one torch._grouped_mm per projection."""
    g = torch.Generator().manual_seed(0)
    T, D, E, k, Fh = s["tokens"], s["D"], s["E"], s["top_k"], s["F"]
    std = 0.02
    x = torch.randn(T, D, generator=g, requires_grad=True)
    router = (torch.randn(D, E, generator=g) * std).requires_grad_()
    w_gate, w_up = ((torch.randn(E, D, Fh, generator=g) * std).requires_grad_() for _ in range(2))
    w_down = (torch.randn(E, Fh, D, generator=g) * std).requires_grad_()
    dy = torch.randn(T, D, generator=g)
    leaves = (x, router, w_gate, w_up, w_down)

    def forward():
        probs = torch.softmax(x @ router, dim=-1)
        top, experts = torch.topk(probs, k, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        if s["impl"] == "index_add":
            out = torch.zeros_like(x)
            for e in range(E):
                token, slot = torch.where(experts == e)
                h = x[token]
                y = (F.silu(h @ w_gate[e]) * (h @ w_up[e])) @ w_down[e]
                out = out.index_add(0, token, y * weights[token, slot, None])
            return out
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        h = x[token]
        a = F.silu(torch._grouped_mm(h, w_gate, offs=offs)) * torch._grouped_mm(h, w_up, offs=offs)
        y = torch._grouped_mm(a, w_down, offs=offs)
        return torch.zeros_like(x).index_add(0, token, y * weights.reshape(-1)[order, None])

    def step():
        torch.autograd.grad(forward(), leaves, dy)

    step()
    return lambda: {"time": timed(step, s["reps"])}


# ---------------------------------------------------------------- checkpoint save / restore


def checkpoint(s: dict):
    """torch.distributed.checkpoint (no process group: one rank) of model + AdamW state."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = Decoder(model_args(s))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, s["vocab_size"], (1, 9))
    F.cross_entropy(model(tokens[:, :-1]).reshape(-1, s["vocab_size"]), tokens[:, 1:].reshape(-1)).backward()
    opt.step()  # creates the moments
    for t in opt.state.values():  # random, not zeros: trained moments don't compress away
        t["exp_avg"].normal_()
        t["exp_avg_sq"].normal_()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    root = tempfile.mkdtemp(prefix="bench-dcp-", dir=s["dir"])
    count = [0]

    def window():
        count[0] += 1
        path = os.path.join(root, str(count[0]))
        quiet_disk()
        t = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        os.sync()  # as Orbax's commit: the bytes are on disk before the save counts as done
        save_s = time.perf_counter() - t
        target = {"model": Decoder(model_args(s)).state_dict(), "optim": opt.state_dict()}
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=path)
        load_s = time.perf_counter() - t
        assert all(torch.equal(a, b) for a, b in zip(_tensors(target), _tensors(state), strict=True))
        return {"save": save_s, "restore": load_s, "bytes": nbytes}

    window()  # warm-up, as ours
    return window


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


# ---------------------------------------------------------------- KV-cache decoding


def decode(s: dict):
    """Prefill, then one token per step with a static KV cache (every slot attended with a mask,
    so shapes never change and torch.compile traces the step once), temperature + top-k sampling,
    each step's tokens brought to the host as streaming does."""
    torch.manual_seed(0)
    a = model_args(s)
    model = Decoder(a).eval()
    B, P, new = s["batch"], s["prompt_len"], s["new_tokens"]
    slots = P + new
    K, H = a.n_kv_heads, a.head_dim
    cache = [(torch.zeros(B, K, slots, H), torch.zeros(B, K, slots, H)) for _ in model.blocks]

    def forward(tokens_BT, pos_T):
        x = model.embed(tokens_BT)
        Bq, T, _ = x.shape
        mask_TS = torch.arange(slots)[None, :] <= pos_T[:, None]
        for blk, (ck, cv) in zip(model.blocks, cache, strict=True):
            h = blk.attn_norm(x)
            q = blk.wq(h).view(Bq, T, a.n_heads, H).transpose(1, 2)
            k = blk.wk(h).view(Bq, T, K, H).transpose(1, 2)
            v = blk.wv(h).view(Bq, T, K, H).transpose(1, 2)
            q, k = rope(q, a.rope_theta, pos_T), rope(k, a.rope_theta, pos_T)
            ck.index_copy_(2, pos_T, k)
            cv.index_copy_(2, pos_T, v)
            o = F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask_TS, enable_gqa=True)
            x = x + blk.wo(o.transpose(1, 2).reshape(Bq, T, -1))
            h = blk.mlp_norm(x)
            x = x + blk.w_down(F.silu(blk.w_gate(h)) * blk.w_up(h))
        return model.head(model.norm(x[:, -1]))

    def pick(logits_BV, g):
        top, idx = torch.topk(logits_BV / 0.8, 40, dim=-1)
        return idx.gather(-1, torch.multinomial(torch.softmax(top, -1), 1, generator=g))

    step_fn = torch.compile(forward) if s["compile"] else forward
    prompt = torch.randint(0, a.vocab_size, (B, P), generator=torch.Generator().manual_seed(1))

    def generate():
        g = torch.Generator().manual_seed(2)
        stamps = []
        with torch.inference_mode():
            logits = forward(prompt, torch.arange(P))
            for t in range(new):
                nxt = pick(logits, g)
                nxt.numpy()  # to the host, as a streaming server would
                stamps.append(time.perf_counter())
                if t + 1 < new:
                    logits = step_fn(nxt, torch.tensor([P + t]))
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    generate()  # compile / warm up
    return lambda: {"time": generate()}


# ---------------------------------------------------------------- 2-process DDP over gloo


def ddp(s: dict):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    os.sched_setaffinity(0, {s["rank"] % os.cpu_count()})  # one core per process, as ours
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{s['port']}", rank=s["rank"], world_size=s["world"]
    )
    torch.manual_seed(0)
    a = model_args(s)
    model = DistributedDataParallel(Decoder(a))
    sent = [0]

    def counting_allreduce(state, bucket):
        sent[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rows = s["batch"] // s["world"]
    g = torch.Generator().manual_seed(1 + s["rank"])
    tokens = torch.randint(0, a.vocab_size, (rows, s["seq_len"] + 1), generator=g)

    def step():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(s["warmup"]):
        step()

    def window():
        before = sent[0]
        t = timed(step, s["steps"])
        return {"time": t, "bytes_per_step": (sent[0] - before) / s["steps"]}

    return window


KINDS = {
    "train": train,
    "attention": attention,
    "moe": moe,
    "checkpoint": checkpoint,
    "decode": decode,
    "ddp": ddp,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="JSON: kind and its sizes")
    spec = json.loads(p.parse_args().spec)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    window = KINDS[spec["kind"]](spec)
    say({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        say(window())


if __name__ == "__main__":
    main()
