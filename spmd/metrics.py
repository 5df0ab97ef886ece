"""Peak FLOP/s for MFU, and the run's metric sinks: metrics.jsonl, TensorBoard, a loss-curve PNG."""

import contextlib
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

from spmd.data import cache_dir
from spmd.errors import UserError
from spmd.hardware import chip_for

MATMUL_N = 2048


def _host_count() -> int:
    """Distinct machines in the job (several processes may share one, as with spmd-launch)."""
    if jax.process_count() == 1:
        return 1
    import socket
    import zlib

    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.uint32(zlib.crc32(socket.gethostname().encode()))
    return len(set(np.asarray(multihost_utils.process_allgather(mine)).ravel().tolist()))


def measure_matmul_flops(dtype: str, n: int = MATMUL_N, reps: int = 7) -> float:
    """Median FLOP/s of an n x n matmul on device 0 of the default backend."""
    x = jax.device_put(jnp.ones((n, n), jnp.dtype(dtype)), jax.devices()[0])
    f = jax.jit(lambda a, b: a @ b)
    f(x, x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x, x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def peak_flops(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of the whole job, how it was obtained).

    On CPU the fake devices share the host's cores, so one host's measured matmul rate is the peak
    of all its devices together; it is measured once per host kind and dtype and cached.
    """
    device = jax.devices()[0]
    known = chip_for(device.device_kind) if device.platform != "cpu" else None
    if known is not None:
        chip = known[1]
        return chip.peak_flops * jax.device_count(), (
            f"table: {chip.device_kinds[0]} {chip.peak_flops / 1e12:.0f} TFLOP/s/device x {jax.device_count()}"
        )
    key = f"{device.platform}|{device.device_kind}|{dtype}|{os.cpu_count()}|jax {jax.__version__}"
    path = cache_dir() / "peak_flops.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if key not in cached:
        cached[key] = measure_matmul_flops(dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
        how = "measured now"
    else:
        how = "measured earlier, cached"
    per_host = cached[key]
    hosts = _host_count()
    return per_host * hosts, (
        f"{how}: {MATMUL_N}x{MATMUL_N} {dtype} matmul on {device.platform} = {per_host / 1e9:.1f} GFLOP/s per host"
        f" x {hosts} host{'s' if hosts > 1 else ''}"
    )


class MetricsWriteError(UserError):
    """The run directory's metrics could not be written (disk full, permissions): training stops
    with exit code 3, as for a checkpoint that cannot be written."""

    exit_code = 3


class MetricsWriter:
    """Writes each logged step to metrics.jsonl and TensorBoard; draws loss.png at the end."""

    def __init__(self, run_dir: pathlib.Path):
        import logging

        from tensorboardX import SummaryWriter

        # A skipped (non-finite) step is logged as NaN on purpose; the step line already says so.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        # A resumed run continues the file (already trimmed to the restored step), and its plot.
        self.history: list[dict] = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
        self.jsonl = open(path, "a")
        self.failed: MetricsWriteError | None = None
        self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        self.history.append(record)
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        except OSError as e:
            self.failed = MetricsWriteError(
                f"step {record.get('step')}'s metrics could not be written to {self.jsonl.name}: "
                f"{e.strerror or e}; training stopped"
            )
            raise self.failed from None
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.failed is not None:  # what is buffered cannot be written either: drop it quietly
            with contextlib.suppress(OSError):
                self.jsonl.close()
            with contextlib.suppress(Exception):  # TensorBoard's writer thread meets the same disk
                self.tb.close()
            return
        self.jsonl.close()
        self.tb.close()
        self.plot()

    def plot(self) -> None:
        if not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        train = [(r["step"], r["loss"]) for r in self.history if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in self.history if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train), label="train loss")
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.run_dir / "loss.png", dpi=100)
        plt.close(fig)
