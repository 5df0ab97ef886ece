"""KV-cache decode throughput of `small` on one device: tokens/s at batch 1 and 16.

    python scripts/bench_decode.py [--new-tokens 128] [--prompt-len 16]

Parameters are freshly initialised (decode speed does not depend on their values). Each batch size
decodes once to compile, then is timed over a second full generation; tokens/s counts new tokens
of all rows.
"""

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    args = p.parse_args()

    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    from spmd.assembly.config import load_config
    from spmd.assembly.setup import assemble
    from spmd.io.inference import Loaded, Sampler

    cfg = load_config(args.config)
    print(
        f"\n`{args.config}` ({cfg.model.dtype} compute), 1 CPU device ({jax.devices()[0].device_kind}), prompt "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens, temperature 0.8, top-k 40\n"
    )
    print("| batch | decode tokens/s | ms per step | prefill ms |")
    print("|---:|---:|---:|---:|")
    for batch in (1, 16):
        setup = assemble(
            cfg, "", "dp", devices=jax.devices()[:1], optimizer=False, decoding=True, batch_size=batch
        )
        plan = setup.plan
        params = jax.jit(lambda: plan.init_params(cfg.train.seed), out_shardings=plan.param_shardings)()
        sampler = Sampler(Loaded(setup, 0, {}, params))
        prompts = [np.random.default_rng(i).integers(0, 256, args.prompt_len) for i in range(batch)]
        sampler.generate(prompts, args.new_tokens, 0.8, 40, 0)  # compile
        stamps = []
        t0 = time.perf_counter()
        sampler.generate(
            prompts, args.new_tokens, 0.8, 40, 1, on_token=lambda t, _: stamps.append(time.perf_counter())
        )
        prefill = stamps[0] - t0
        step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        print(f"| {batch} | {batch / step:,.0f} | {step * 1e3:.2f} | {prefill * 1e3:.1f} |")


if __name__ == "__main__":
    main()
