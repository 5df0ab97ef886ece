"""Peak FLOP/s for MFU, and the run's metric sinks: metrics.jsonl (always: resume trims it to the
restored step), the `[metrics]` table's backends (TensorBoard, Weights & Biases, MLflow) and a
loss-curve PNG."""

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import secrets
import statistics
import time

import jax
import jax.numpy as jnp

from spmd.analysis.hardware import chip_for
from spmd.core.errors import UserError, log
from spmd.core.paths import cache_dir

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


def measure_matmul_flops(dtype: str, n: int = MATMUL_N, reps: int = 7, library: str = "xla") -> float:
    """Median FLOP/s of an n x n matmul on device 0 of the default backend; on CPU in `library`
    (spmd.assembly.policy.matmul: what the steps run their matmuls in)."""
    from spmd.platform import cpu_matmul

    x = jax.device_put(jnp.ones((n, n), jnp.dtype(dtype)), jax.devices()[0])
    f = cpu_matmul.jit(lambda a, b: a @ b, library)
    f(x, x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x, x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def peak_flops(dtype: str, library: str = "xla") -> tuple[float, str]:
    """(peak FLOP/s of the whole job, how it was obtained).

    On CPU the fake devices share the host's cores, so one host's measured matmul rate is the peak
    of all its devices together; it is measured once per host kind, dtype and matmul `library`
    (the steps': a rate measured in another library is not the steps' ceiling) and cached.
    """
    device = jax.devices()[0]
    known = chip_for(device.device_kind) if device.platform != "cpu" else None
    if known is not None:
        chip = known[1]
        return chip.peak_flops * jax.device_count(), (
            f"table: {chip.device_kinds[0]} {chip.peak_flops / 1e12:.0f} TFLOP/s/device x {jax.device_count()}"
        )
    key = f"{device.platform}|{device.device_kind}|{dtype}|{library}|{os.cpu_count()}|jax {jax.__version__}"
    path = cache_dir() / "peak_flops.json"
    cached = json.loads(path.read_text()) if path.exists() else {}
    if key not in cached:
        cached[key] = measure_matmul_flops(dtype, library=library)
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
        f"{how}: {MATMUL_N}x{MATMUL_N} {dtype} matmul in {library} on {device.platform} = {per_host / 1e9:.1f} "
        "GFLOP/s per host"
        f" x {hosts} host{'s' if hosts > 1 else ''}"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class MetricsWriteError(UserError):
    """The run directory's metrics could not be written (disk full, permissions): training stops
    with exit code 3, as for a checkpoint that cannot be written."""

    exit_code = 3


# Where a run's records go besides metrics.jsonl, and the package (and extra) each needs.
BACKENDS = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
WANDB_MODES = ("", "online", "offline", "disabled")
# The tracker runs a run directory continues on resume (W&B run id, MLflow run id).
TRACKING_FILE = "tracking.json"


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """`[metrics]`: the backends that receive every logged record, the run's config.json and its
    goodput, besides metrics.jsonl."""

    backends: tuple[str, ...] = ("tensorboard",)  # any of BACKENDS
    project: str = "spmd"  # the W&B project and the MLflow experiment
    run_name: str = ""  # "": the run directory's name
    wandb_mode: str = ""  # online, offline or disabled; "": W&B's own choice (WANDB_MODE, login)
    mlflow_tracking_uri: str = ""  # "": MLflow's own (MLFLOW_TRACKING_URI)
    mlflow_timeout: float = 10.0  # seconds an MLflow server gets to answer a request (one retry)

    def __post_init__(self):  # a config.json's list, a TOML array
        object.__setattr__(self, "backends", tuple(self.backends))

    def check(self) -> list[str]:
        problems = [
            f"metrics.backends: unknown backend {name!r}; choose from {', '.join(BACKENDS)}"
            for name in self.backends
            if name not in BACKENDS
        ]
        if len(set(self.backends)) != len(self.backends):
            problems.append(f"metrics.backends names a backend twice: {', '.join(self.backends)}")
        if not 0 < self.mlflow_timeout <= 600:
            problems.append(f"metrics.mlflow_timeout must be in (0, 600] seconds, got {self.mlflow_timeout}")
        if self.wandb_mode not in WANDB_MODES:
            problems.append(
                f"metrics.wandb_mode must be online, offline or disabled (or empty), got {self.wandb_mode!r}"
            )
        return problems


def check_backends(cfg: MetricsConfig) -> None:
    """Every backend the config names is installed: checked before a run writes or compiles anything."""
    for name in cfg.backends:
        if importlib.util.find_spec(BACKENDS[name]) is None:
            raise UserError(
                f"metrics.backends names {name}, but its package {BACKENDS[name]!r} is not installed: "
                f"pip install 'spmd-stack[{name}]', or leave {name} out of metrics.backends"
            )


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
    """A nested dict as dotted keys with string values (MLflow's parameters)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def _scalars(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoardSink:
    def __init__(self, run_dir: pathlib.Path, cfg: MetricsConfig, resolved: dict, tracking: dict):
        import logging

        from tensorboardX import SummaryWriter

        # A skipped (non-finite) step is logged as NaN on purpose; the step line already says so.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.tb.add_scalar(key, value, record["step"])

    def close(self, summary: dict) -> None:
        self.tb.close()


class WandbSink:
    """A W&B run per run directory: created on the first start with the run's config.json as its
    config, continued (same id) on resume. W&B takes steps in increasing order only, so steps that
    a restart runs again keep the values the earlier attempt logged there (metrics.jsonl and
    MLflow hold both)."""

    def __init__(self, run_dir: pathlib.Path, cfg: MetricsConfig, resolved: dict, tracking: dict):
        import wandb

        self.last_step = tracking.get("wandb_step", -1)
        run_id = tracking.get("wandb") or secrets.token_hex(4)
        self.run = wandb.init(
            project=cfg.project, name=cfg.run_name or run_dir.name, id=run_id, resume="allow",
            dir=str(run_dir), config=resolved, mode=cfg.wandb_mode or None,
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        self.run.config.update(resolved, allow_val_change=True)  # a resume on another mesh says so
        self.tracking = tracking
        tracking["wandb"] = run_id

    def write(self, record: dict) -> None:
        if record["step"] <= self.last_step:
            return
        self.run.log(_scalars(record), step=record["step"])
        self.last_step = self.tracking["wandb_step"] = record["step"]

    def close(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()


def mlflow_environment(cfg: MetricsConfig) -> None:
    """MLflow's client reads its settings from the environment: an unreachable server is given
    metrics.mlflow_timeout seconds and one retry (its defaults retry for minutes), and a local
    `file:` store (or a plain directory) is allowed, which mlflow 3 refuses unless told
    (MLFLOW_ALLOW_FILE_STORE): the local recipe that needs no server and no database driver.
    What the user set in the environment wins."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(cfg.mlflow_timeout))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("file:") or uri and "://" not in uri and ":" not in uri.split("/")[0]:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


class MlflowSink:
    """An MLflow run per run directory: the config.json as parameters (dotted keys) and as an
    artifact, each record as metrics at its step; continued on resume, where the config of the
    resumed start is one more artifact (parameters cannot change)."""

    def __init__(self, run_dir: pathlib.Path, cfg: MetricsConfig, resolved: dict, tracking: dict):
        import logging

        import mlflow
        from mlflow.entities import Param

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its experiment-created notices
        mlflow_environment(cfg)
        self.client = mlflow.MlflowClient(tracking_uri=cfg.mlflow_tracking_uri or None)
        if tracking.get("mlflow"):
            self.run_id = tracking["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.log_dict(self.run_id, resolved, f"config.resumed-{int(time.time())}.json")
        else:
            experiment = self.client.get_experiment_by_name(cfg.project)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(cfg.project)
            )
            self.run_id = self.client.create_run(
                experiment_id, run_name=cfg.run_name or run_dir.name
            ).info.run_id
            params = [Param(k, v[:6000]) for k, v in _flat(resolved).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.client.log_dict(self.run_id, resolved, "config.json")
        tracking["mlflow"] = self.run_id

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(k, float(v), stamp, record["step"]) for k, v in _scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, summary: dict) -> None:
        self.client.set_terminated(self.run_id)


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


class MetricsWriter:
    """Writes each logged step to metrics.jsonl and the configured backends; draws loss.png at the
    end. `resolved`: the run's config.json, which the trackers record with the run."""

    def __init__(
        self, run_dir: pathlib.Path, cfg: MetricsConfig = MetricsConfig(), resolved: dict | None = None
    ):
        self.run_dir = run_dir
        path = run_dir / "metrics.jsonl"
        # A resumed run continues the file (already trimmed to the restored step), and its plot.
        self.history: list[dict] = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
        self.failed: MetricsWriteError | None = None
        self.tracking_path = run_dir / TRACKING_FILE
        self.tracking = json.loads(self.tracking_path.read_text()) if self.tracking_path.exists() else {}
        self.sinks: dict[str, object] = {}
        try:
            for name in cfg.backends:
                try:
                    self.sinks[name] = SINKS[name](run_dir, cfg, resolved or {}, self.tracking)
                except Exception as e:  # a tracker that cannot start (not logged in, no server)
                    raise UserError(f"metrics backend {name} could not start: {_first_line(e)}") from None
            self._save_tracking()
        except BaseException:
            self.close(started=False)
            raise
        self.jsonl = open(path, "a")

    def _save_tracking(self) -> None:
        if self.tracking:
            tmp = self.tracking_path.with_name(f".{TRACKING_FILE}.{os.getpid()}")
            tmp.write_text(json.dumps(self.tracking))
            os.replace(tmp, self.tracking_path)

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
        for name, sink in list(self.sinks.items()):
            try:
                sink.write(record)
            except Exception as e:  # a remote tracker's outage does not stop training
                log(f"warning: metrics backend {name} failed and is off for this run ({_first_line(e)}); "
                    f"metrics.jsonl keeps every record")  # fmt: skip
                del self.sinks[name]
                with contextlib.suppress(Exception):
                    sink.close({})
        if "wandb" in self.sinks:  # the last step W&B holds, for a restart
            with contextlib.suppress(OSError):
                self._save_tracking()

    def rewind(self, step: int) -> None:
        """Forget the records after `step` (a rollback): metrics.jsonl is rewritten without them."""
        self.history = [r for r in self.history if r["step"] <= step]
        try:
            self.jsonl.close()
            tmp = self.jsonl.name + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.history)
            os.replace(tmp, self.jsonl.name)
            self.jsonl = open(self.jsonl.name, "a")
        except OSError as e:
            self.failed = MetricsWriteError(f"{self.jsonl.name} could not be rewritten: {e.strerror or e}")
            raise self.failed from None

    def close(self, started: bool = True) -> None:
        summary = {
            k: v
            for k, v in (self.history[-1] if self.history else {}).items()
            if k.startswith(("goodput", "time_"))
        }
        for sink in self.sinks.values():
            with contextlib.suppress(Exception):  # a failed disk or tracker: nothing more to save
                sink.close(summary)
        if not started:
            return
        if self.failed is not None:  # what is buffered cannot be written either: drop it quietly
            with contextlib.suppress(OSError):
                self.jsonl.close()
            return
        self.jsonl.close()
        with contextlib.suppress(OSError):
            self._save_tracking()
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
