"""Checkpoint throughput and the stall an async save causes.

    python scripts/bench/bench_ckpt.py [--dir /tmp/spmd-bench-ckpt] [--layers 2]

Saves and restores the train state of a ~30M-parameter model (params + AdamW moments, fp32,
~375 MB) with our Checkpointer, next to a plain sequential write (with fsync) and read of the same
number of bytes on the same disk; then trains with an async save in flight and compares the
step time to the normal one. One device; prints a Markdown table.
"""

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def state_overrides(layers: int = 2) -> list[str]:
    """`small` grown to d=1024 (2 layers: ~32M parameters, ~366 MiB with the AdamW moments)."""
    return [
        f"model.n_layers={layers}",
        "model.d_model=1024",
        "model.n_heads=16",
        "model.n_kv_heads=8",
        "model.head_dim=64",
        "model.d_ff=4096",
        "model.scan_unroll=1",
        "train.global_batch_size=4",
        "train.seq_len=128",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/spmd-bench-ckpt")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    from spmd.assembly.setup import assemble
    from spmd.io import checkpoint as ckpt

    setup = assemble(
        "small",
        "",
        "dp",
        devices=jax.devices()[:1],
        overrides=state_overrides(args.layers),
    )
    trainer, batches = setup.trainer, setup.batches()
    state = trainer.init_state()
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    root = pathlib.Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    # Raw disk: one sequential write (fsync'd) and read of the same bytes.
    blob = np.random.default_rng(0).integers(0, 255, size=n_bytes, dtype=np.uint8)
    raw_w, raw_r = [], []
    for i in range(args.repeats):
        path = root / f"raw{i}.bin"
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(blob.data)
            f.flush()
            os.fsync(f.fileno())
        raw_w.append(time.perf_counter() - t)
        t = time.perf_counter()
        with open(path, "rb") as f:
            f.readinto(bytearray(n_bytes))
        raw_r.append(time.perf_counter() - t)
        path.unlink()

    # Checkpointer: synchronous save (to the commit) and restore onto the same sharding.
    save_t, restore_t = [], []
    for i in range(args.repeats):
        run_dir = root / f"sync{i}"
        writer = ckpt.Checkpointer(run_dir, ckpt.CheckpointConfig(async_save=False))
        t = time.perf_counter()
        writer.save(1, state, {"step": 1})
        writer.close()
        save_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        restored, _ = ckpt.restore(run_dir / ckpt.SUBDIR, 1, trainer.abstract_state)
        jax.block_until_ready(restored)
        restore_t.append(time.perf_counter() - t)
        shutil.rmtree(run_dir)

    # Compression A/B, alternating: Orbax's default (zstd, what spmd.io.checkpoint wrote before) against
    # our writer (uncompressed); save to the commit, then restore; bytes on disk. On a state of
    # random normal values: a fresh state's zero Adam moments compress to nothing, trained ones don't.
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(1)
    fresh = state
    state = jax.tree.map(
        lambda x: (
            jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
            if x.dtype.kind == "f"
            else x
        ),
        fresh,
    )

    def zstd_save(run_dir):
        manager = ocp.CheckpointManager(
            (run_dir / ckpt.SUBDIR).resolve(),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )
        manager.save(
            1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({}))
        )
        manager.close()

    def ours_save(run_dir):
        writer = ckpt.Checkpointer(run_dir, ckpt.CheckpointConfig(async_save=False))
        writer.save(1, state, {"step": 1})
        writer.close()

    ab = {"zstd": ([], [], []), "none": ([], [], [])}
    for i in range(args.repeats):
        for name, fn in (("zstd", zstd_save), ("none", ours_save)):
            run_dir = root / f"ab-{name}{i}"
            t = time.perf_counter()
            fn(run_dir)
            ab[name][0].append(time.perf_counter() - t)
            t = time.perf_counter()
            restored, _ = ckpt.restore(run_dir / ckpt.SUBDIR, 1, trainer.abstract_state)
            jax.block_until_ready(restored)
            ab[name][1].append(time.perf_counter() - t)
            ab[name][2].append(sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file()))
            shutil.rmtree(run_dir)

    # Checksums (spmd.io.checkpoint.checksums, part of every save and restore): their pass alone,
    # alternating with a save, on the same random state.
    ckpt.checksums(state)  # compile
    sums, saves = [], []
    for i in range(args.repeats):
        t = time.perf_counter()
        ckpt.checksums(state)
        sums.append(time.perf_counter() - t)
        run_dir = root / f"sum{i}"
        t = time.perf_counter()
        ours_save(run_dir)
        saves.append(time.perf_counter() - t)
        shutil.rmtree(run_dir)
    state = fresh

    # Stall: step times with no save, then while an async save is being written.
    step_fn = trainer.train_step.lower(state, batches.train_batch(0)).compile()

    def timed_step(state, step):
        t = time.perf_counter()
        state, _ = step_fn(state, batches.train_batch(step))
        jax.block_until_ready(state)
        return state, time.perf_counter() - t

    normal = []
    for step in range(8):
        state, dt = timed_step(state, step)
        normal.append(dt)
    normal = normal[2:]
    writer = ckpt.Checkpointer(root / "async", ckpt.CheckpointConfig(async_save=True))
    t = time.perf_counter()
    writer.save(8, state, {"step": 8})
    blocking = time.perf_counter() - t
    during, step = [], 8
    while writer.manager.is_saving_in_progress() or not during:
        state, dt = timed_step(state, step)
        during.append(dt)
        step += 1
    writer.close()
    background = time.perf_counter() - t

    mb = n_bytes / 2**20
    med = statistics.median
    print(
        f"\nstate: {sum(x.size for x in jax.tree.leaves(state['params'])):,} params + AdamW moments, "
        f"{mb:,.0f} MiB; median of {args.repeats}; dir {root}\n"
    )
    print("| operation | seconds | MiB/s | ratio to raw disk |")
    print("|---|---:|---:|---:|")
    print(f"| raw sequential write + fsync | {med(raw_w):.2f} | {mb / med(raw_w):,.0f} | 1.00 |")
    print(
        f"| checkpoint save (sync, to commit) | {med(save_t):.2f} | {mb / med(save_t):,.0f} | {med(raw_w) / med(save_t):.2f} |"
    )
    print(f"| raw sequential read | {med(raw_r):.2f} | {mb / med(raw_r):,.0f} | 1.00 |")
    print(
        f"| checkpoint restore | {med(restore_t):.2f} | {mb / med(restore_t):,.0f} | {med(raw_r) / med(restore_t):.2f} |"
    )
    print(
        "\n| compression (alternating) | save s | restore s | MiB on disk | save speed vs zstd (median of ratios) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, (sv, rs, size) in ab.items():
        ratio = med(a / b for a, b in zip(ab["zstd"][0], sv))
        print(f"| {name} | {med(sv):.2f} | {med(rs):.2f} | {med(size) / 2**20:,.0f} | {ratio:.2f}x |")
    print(
        f"\nchecksums: {med(sums) * 1e3:.0f} ms per pass over the {mb:,.0f} MiB state, "
        f"{med(s / v for s, v in zip(sums, saves)):.1%} of a save that includes it (median of ratios)"
    )
    print(
        f"\nasync save: save() blocked the loop {blocking * 1e3:.0f} ms; the write finished in the background after "
        f"{background:.2f} s, during which {len(during)} steps ran at a median {med(during) * 1e3:.0f} ms vs "
        f"{med(normal) * 1e3:.0f} ms normally: stall {med(during) / med(normal):.2f}x "
        f"(including the blocking part over those steps: "
        f"{(sum(during) + blocking) / len(during) / med(normal):.2f}x)"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
