"""Attention benchmarks.

    python scripts/bench/bench_attention.py            # CPU: compiled temporary memory of a train step
    python scripts/bench/bench_attention.py --gpu      # GPU: TFLOP/s of our Pallas kernel vs cuDNN and XLA

CPU: the `tiny` model's train step (batch 1) is compiled, not run, for T from 1k to 16k with `xla`
and `chunked` attention, and `memory_analysis()` gives its temporary bytes: O(T^2) against O(T).

GPU (needs an accelerator; not yet run in this project's sessions): forward and forward+backward
TFLOP/s, bf16, head dim 64 and 128, causal and not, of `flash_attention`, cuDNN
(`jax.nn.dot_product_attention(implementation='cudnn')`) and plain XLA attention. FLOPs count
4*B*N*T*T*H forward (halved when causal) and 2.5x that for forward+backward.
"""

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def cpu_memory(lengths):
    import jax

    jax.config.update("jax_platforms", "cpu")
    from spmd.assembly.setup import assemble
    from spmd.parallel.sharding import fmt_bytes

    print("\n`tiny` train step (batch 1, 4 heads, fp32), compiled temporary memory per device:\n")
    print("| T | xla | chunked | xla / chunked |")
    print("|---:|---:|---:|---:|")
    for T in lengths:
        temps = {}
        for impl in ("xla", "chunked"):
            sets = [f"train.seq_len={T}", "train.global_batch_size=1", f"model.attention_impl={impl}"]
            trainer = assemble("tiny", "", "dp", overrides=sets, devices=jax.devices()[:1]).trainer
            batch = trainer.abstract_batch(1, T)
            state = trainer.abstract_state
            temps[impl] = (
                trainer.train_step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
            )
        print(
            f"| {T:,} | {fmt_bytes(temps['xla'])} | {fmt_bytes(temps['chunked'])} | "
            f"{temps['xla'] / temps['chunked']:.1f}x |",
            flush=True,
        )


def gpu_throughput(lengths, repeats=10):
    import jax
    import jax.numpy as jnp

    from spmd.kernels.flash_attention import flash_attention
    from spmd.models.attention import xla_attention

    impls = {
        "pallas": lambda q, k, v, c: flash_attention(q, k, v, causal=c),
        "cudnn": lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="cudnn"
        ),
        "xla": lambda q, k, v, c: xla_attention(q, k, v, causal=c),
    }
    print("\n| T | H | causal | impl | fwd TFLOP/s | fwd+bwd TFLOP/s |")
    print("|---:|---:|---|---|---:|---:|")
    for T in lengths:
        for H in (64, 128):
            B, N = max(1, 16384 // T), 2048 // H
            key = jax.random.split(jax.random.key(0), 3)
            q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.bfloat16) for kk in key)
            for causal in (True, False):
                flops = 4 * B * N * T * T * H / (2 if causal else 1)
                for name, fn in impls.items():
                    fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, causal))
                    bwd = jax.jit(
                        jax.grad(
                            lambda q, k, v, fn=fn: fn(q, k, v, causal).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2),
                        )
                    )
                    row = []
                    for f, mult in ((fwd, 1.0), (bwd, 2.5)):
                        try:
                            jax.block_until_ready(f(q, k, v))
                            ts = []
                            for _ in range(repeats):
                                t = time.perf_counter()
                                jax.block_until_ready(f(q, k, v))
                                ts.append(time.perf_counter() - t)
                            row.append(f"{mult * flops / statistics.median(ts) / 1e12:.1f}")
                        except Exception as e:  # noqa: BLE001 — e.g. XLA attention out of memory at 16k
                            row.append(f"failed ({type(e).__name__})")
                    print(f"| {T:,} | {H} | {causal} | {name} | {row[0]} | {row[1]} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    gpu_throughput(lengths) if args.gpu else cpu_memory(lengths)


if __name__ == "__main__":
    main()
