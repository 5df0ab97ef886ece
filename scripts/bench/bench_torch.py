"""PyTorch eager baseline: the same Llama-style architecture, batch and optimizer as `small`.

Run in its own Python 3.11 venv with the CPU torch wheel (see docs/performance.md):
    .venv-torch/bin/python scripts/bench/bench_torch.py --d-model 256 --n-layers 4 ...
Prints one JSON line: tokens/s from the median step time.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.scale, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def rope(x_BNTH, theta, positions_T=None):
    T, H = x_BNTH.shape[-2], x_BNTH.shape[-1]
    half = H // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x_BNTH.device) / half)
    pos_T = torch.arange(T, device=x_BNTH.device) if positions_T is None else positions_T
    angle = pos_T.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x_BNTH[..., :half], x_BNTH[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        D, N, K, H, Fh = a.d_model, a.n_heads, a.n_kv_heads, a.head_dim, a.d_ff
        self.a = a
        self.attn_norm, self.mlp_norm = RMSNorm(D), RMSNorm(D)
        self.wq, self.wk, self.wv = (
            nn.Linear(D, N * H, bias=False),
            nn.Linear(D, K * H, bias=False),
            nn.Linear(D, K * H, bias=False),
        )
        self.wo = nn.Linear(N * H, D, bias=False)
        self.w_gate, self.w_up, self.w_down = (
            nn.Linear(D, Fh, bias=False),
            nn.Linear(D, Fh, bias=False),
            nn.Linear(Fh, D, bias=False),
        )

    def forward(self, x):
        a = self.a
        B, T, D = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = rope(q, a.rope_theta), rope(k, a.rope_theta)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Decoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.d_model)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.d_model)
        self.head = nn.Linear(a.d_model, a.vocab_size, bias=False)
        if getattr(a, "tie_embeddings", False):  # the output head is the embedding table
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    for name, default in (
        ("vocab-size", 256),
        ("d-model", 256),
        ("n-layers", 4),
        ("n-heads", 8),
        ("n-kv-heads", 4),
        ("head-dim", 32),
        ("d-ff", 768),
        ("batch", 16),
        ("seq-len", 128),
        ("steps", 20),
        ("warmup", 3),
        ("threads", 0),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute dtype; bfloat16 runs the forward under CPU autocast (params stay fp32)",
    )
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Decoder(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, a.vocab_size, (a.batch, a.seq_len + 1))
    times = []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bfloat16"):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    n = sum(p.numel() for p in model.parameters())
    matmul_params = n - a.vocab_size * a.d_model  # the lookup table is no matmul; norms counted as in JAX
    flops = (
        6 * matmul_params + 6 * a.n_layers * a.seq_len * a.n_heads * a.head_dim
    )  # as spmd.models.llama.flops_per_token
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "step_time": step,
                "dtype": a.dtype,
                "flops_per_token": flops,
                "tokens_per_sec": a.batch * a.seq_len / step,
                "loss": loss.item(),
            }
        )
    )


if __name__ == "__main__":
    main()
