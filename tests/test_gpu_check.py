"""The prepared GPU check (scripts/gpu/gpu_check.py) runs end to end at toy sizes on this CPU host,
so that the one script a GPU session runs does not rot while no GPU is at hand."""

import json
import os
import subprocess
import sys

from conftest import ROOT

from spmd.kernels import tuning
from spmd.kernels.flash_attention import BlockSizes, triton_params


def test_gpu_check_runs_every_section_at_toy_sizes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "gpu_check.py"), "--smoke", "--sweep-seconds", "1",
         "--torch-python", "", "--rounds", "1", "--steps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**env, "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["correctness"]
    assert {(r["impl"], r["dtype"], r["segments"]) for r in rows} == {
        (i, d, s)
        for i in ("xla", "chunked", "pallas")
        for d in ("bfloat16", "float32")
        for s in (False, True)
    }
    for r in rows:  # every implementation, forward and gradients, against the fp32 reference
        limit = 1e-5 if r["dtype"] == "float32" else 2e-2
        assert max(r[k] for k in ("out", "dq", "dk", "dv")) < limit, r
    table = tuning.entries(tmp_path / "tuned.toml")
    assert [(e.device_kind, e.seq_len, e.fastest) for e in table] == [
        ("cpu", 64, "pallas"),
        ("cpu", 128, "pallas"),
    ]
    assert BlockSizes(**table[0].blocks)  # the sweep's best is a valid block configuration
    (train,) = report["train"]
    assert train["tok_s"] > 0 and "torch_tok_s" not in train
    md = (tmp_path / "gpu_check.md").read_text()
    for title in ("against the float32 reference", "Attention TFLOP/s", "Train step"):
        assert title in md
    assert done.stdout.count("\n|---") == 3  # the three tables, printed as each section ends


def test_triton_gets_the_measured_warps_and_stages():
    assert triton_params(BlockSizes(), interpret=False) is None  # Triton's defaults
    assert triton_params(BlockSizes(num_warps=8), interpret=True) is None
    params = triton_params(BlockSizes(num_warps=8, num_stages=3), interpret=False)
    assert (params.num_warps, params.num_stages) == (8, 3)
