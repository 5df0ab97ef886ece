"""scripts/bench/bench_vs_torch.py: our side's workers answer the orchestrator's protocol with real
measurements, and bad flags are refused. (PyTorch's side needs its own venv: not run here.)"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench" / "bench_vs_torch.py"


def worker(spec: dict, windows: int = 2) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--worker", "--spec", json.dumps(spec)],
        input="run\n" * windows + "quit\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line[3:]) for line in out.stdout.splitlines() if line.startswith("@@ ")]


def test_attention_worker_measures_time_and_memory():
    ready, *windows = worker(
        {"kind": "attention", "impl": "xla", "B": 1, "T": 256, "N": 4, "K": 2, "H": 16, "reps": 2}
    )
    assert ready["ready"] and len(windows) == 2
    for w in windows:
        assert 0 < w["time"] < 10
        # fwd+bwd of 4 heads x 256 x 256 fp32 scores holds at least one (4, 256, 256) array
        assert w["temp_bytes"] >= 4 * 256 * 256 * 4
        assert w["peak_bytes"] >= 0


def test_moe_worker_runs_both_dispatches():
    for impl in ("capacity", "dropless"):
        ready, w = worker({"kind": "moe", "impl": impl, "B": 2, "T": 32, "reps": 2}, windows=1)
        assert ready["ready"] and 0 < w["time"] < 10


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--only", "train,bogus"], "unknown group(s) bogus"),
        (["--torch-python", "/nonexistent/python"], "--torch-python /nonexistent/python not found"),
    ],
)
def test_bad_flags_are_refused(flags, message):
    out = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.startswith("error:") and message in out.stderr
    assert "Traceback" not in out.stderr
