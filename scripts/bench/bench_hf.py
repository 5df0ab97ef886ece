"""Hugging Face import and export throughput against the safetensors library alone.

    python scripts/bench/bench_hf.py [--dir /tmp/spmd-bench-hf] [--layers 4] [--repeats 3]

Writes a random Llama (d_model 2048, d_ff 5632, vocab 32000, fp32; ~1.3 GB at 4 layers) with
`safetensors.numpy.save_file`, then alternates, A B A B:

- import: `spmd.io.hf.import_hf` (read every tensor's shards from the files, place them, write the
  Orbax checkpoint) against `safetensors.numpy.load_file` of the same files (read only);
- export: `spmd.io.hf.export_hf` (restore, gather to host, convert, write safetensors) against
  `safetensors.numpy.save_file` of the same tensors (write only).

Throughput is model bytes / wall seconds; the ratio is ours / the library's per pair, and the
table shows medians. Both directions move the whole model through a read *and* a write (import
reads safetensors and writes a checkpoint; export reads a checkpoint and writes safetensors), so
the last column compares with the library reading and then writing the same bytes (load_file +
save_file), the floor of any conversion. One device (CPU); input files in page cache.
"""

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def write_model(directory: pathlib.Path, layers: int) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    D, F, V, N, K = 2048, 5632, 32000, 16, 8
    H = D // N
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
        "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": N,
        "num_key_value_heads": K, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "max_position_embeddings": 2048,
    }  # fmt: skip
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "model.norm.weight": (D,),
    }  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": (N * H, D), p + "self_attn.k_proj.weight": (K * H, D),
            p + "self_attn.v_proj.weight": (K * H, D), p + "self_attn.o_proj.weight": (D, N * H),
            p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D), p + "mlp.down_proj.weight": (D, F),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        })  # fmt: skip
    arrays = {k: rng.standard_normal(s, dtype=np.float32) for k, s in tensors.items()}
    save_file(arrays, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return sum(a.nbytes for a in arrays.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/spmd-bench-hf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import jax

    jax.config.update("jax_platforms", "cpu")
    from safetensors.numpy import load_file, save_file

    from spmd.io import hf

    root = pathlib.Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    src = root / "hf"
    n_bytes = write_model(src, args.layers)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def ours_import():
        shutil.rmtree(root / "run", ignore_errors=True)
        hf.import_hf(str(src), str(root / "run"), mesh="fsdp=1", rules="dp")

    def lib_read():
        tensors = load_file(str(src / "model.safetensors"))
        assert sum(a.nbytes for a in tensors.values()) == n_bytes

    def ours_export():
        shutil.rmtree(root / "out", ignore_errors=True)
        hf.export_hf(str(root / "run"), str(root / "out"), mesh="fsdp=1", rules="dp")

    tensors = load_file(str(src / "model.safetensors"))

    def lib_write():
        save_file(tensors, str(root / "plain.safetensors"), metadata={"format": "pt"})

    def lib_copy():
        lib_read()
        lib_write()

    ours_import(), lib_read()  # warm page cache and compile caches on both sides
    rows = {"import": [], "export": []}
    for _ in range(args.repeats):
        for name, ours, lib in (("import", ours_import, lib_read), ("export", ours_export, lib_write)):
            rows[name].append((timed(ours), timed(lib), timed(lib_copy)))
    mb = n_bytes / 1e6
    med = statistics.median
    print(f"model: {args.layers} layers, {mb:,.0f} MB fp32; {args.repeats} A/B/C rounds; medians\n")
    print(
        "| direction | ours MB/s | safetensors alone MB/s | ratio (ours / library) "
        "| library read + write MB/s | ratio (ours / read + write) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in rows.items():
        print(
            f"| {name} | {med(mb / a for a, _, _ in runs):,.0f} | {med(mb / b for _, b, _ in runs):,.0f} "
            f"| {med(b / a for a, b, _ in runs):.2f} | {med(mb / c for _, _, c in runs):,.0f} "
            f"| {med(c / a for a, _, c in runs):.2f} |"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
