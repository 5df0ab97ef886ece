"""How close imported Hugging Face models come to transformers' own logits (docs/model-families.md).

    python scripts/parity/hf_parity.py [NAME ...]   (default: every fixture in tests/fixtures/hf)

Each fixture is imported in fp32 (spmd-ckpt import-hf's code), then its logits for the fixture's
tokens are compared with those transformers computed, on one device and on fsdp=2,tensor=2.
Prints a markdown table: the largest absolute difference and the largest logit.
"""

import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def main(names: list[str]) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from spmd.assembly.config import config_from_json
    from spmd.assembly.setup import assemble
    from spmd.io import checkpoint as ckpt
    from spmd.io import hf

    names = names or sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").is_file())
    print("| fixture | max abs logit difference, one device | on fsdp=2,tensor=2 | largest logit |")
    print("|---|---:|---:|---:|")
    for name in names:
        run_dir = pathlib.Path(tempfile.mkdtemp()) / "run"
        hf.import_hf(str(FIXTURES / name), str(run_dir), overrides=["model.dtype=float32"])
        ref = np.load(FIXTURES / name / "reference.npz")
        directory, step = ckpt.locate(str(run_dir))
        cfg = config_from_json(ckpt.read_meta(directory, step)["run"]["config"])
        errors = []
        for mesh, rules, n in (("", "dp", 1), ("fsdp=2,tensor=2", "fsdp_tp", 4)):
            setup = assemble(cfg, mesh, rules, devices=jax.devices()[:n], optimizer=False, batch_size=0)
            params, _ = ckpt.restore_params(directory, step, setup.plan.abstract_params)
            plan = setup.plan

            @jax.jit
            def forward(params, tokens, plan=plan):
                with plan.activate():
                    return nnx.merge(plan.graphdef, params)(tokens)

            errors.append(np.abs(np.asarray(forward(params, ref["tokens"])) - ref["logits"]).max())
        print(f"| {name} | {errors[0]:.1e} | {errors[1]:.1e} | {np.abs(ref['logits']).max():.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
