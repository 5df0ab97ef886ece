"""Weights & Biases and MLflow as metrics backends (`metrics.backends`), run offline: each receives
every logged record at its step, the run's config.json (config, mesh, rules) and its goodput, and
continues the same tracker run when the run directory resumes. A backend that is not installed or
cannot start is one error before anything is compiled."""

import json
import pathlib
import struct

import pytest

from spmd import run
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError

wandb = pytest.importorskip("wandb", reason="the wandb extra (pip install '.[wandb]')")
mlflow = pytest.importorskip("mlflow", reason="the mlflow extra (pip install '.[mlflow]')")

OVERRIDES = [
    "train.log_every=2", "train.eval_every=0", "checkpoint.every=2", "checkpoint.async_save=false",
    "metrics.backends=tensorboard,wandb,mlflow", "metrics.project=docs-test", "metrics.wandb_mode=offline",
]  # fmt: skip


def wandb_records(run_dir: pathlib.Path) -> list:
    """The records of every offline W&B run file under `run_dir` (LevelDB log blocks of 32 KiB
    after a 7-byte ':W&B' header; each record a wandb_internal Record), in order."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        raw, pos, pending = path.read_bytes(), 7, b""
        assert raw[:4] == b":W&B"
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
            if (length, kind) == (0, 0):
                pos += 32768 - pos % 32768
                continue
            pending += raw[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL, LAST
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                out.append(record)
                pending = b""
    return out


def test_wandb_and_mlflow_receive_records_config_and_goodput_and_continue_on_resume(
    tmp_path, devices, monkeypatch
):
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    # the local recipe (docs/training.md): a file: store, which mlflow 3 refuses unless told; we tell it
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run"
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=4"])
    first = run.train(assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2]), run_dir)
    tracking = json.loads((run_dir / "tracking.json").read_text())
    assert set(tracking) == {"wandb", "mlflow", "wandb_step"} and tracking["wandb_step"] == 4

    # Resumed on another mesh: the same tracker runs continue.
    longer = load_config("tiny", [*OVERRIDES, "train.steps=6"])
    second = run.train(assemble(longer, "data=2", "dp", devices=devices[:2]), run_dir)
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow"] == tracking["mlflow"]
    logged = {r["step"]: r for r in first.metrics + second.metrics}
    assert sorted(logged) == [2, 4, 6]

    # W&B: one run id; its config is config.json (the mesh and rules of the resumed start win),
    # its history every record at its step, its summary the goodput.
    records = wandb_records(run_dir)
    assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == {tracking["wandb"]}
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        updates = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        config.update({u.key: json.loads(u.value_json) for u in updates})
    assert config["rules"]["name"] == "dp" and config["mesh"]["spec"] == "data=2"
    assert config["config"]["model"]["d_model"] == cfg.model.d_model
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[item["_step"]] = item
    assert sorted(history) == [2, 4, 6]
    for step, record in logged.items():
        assert history[step]["loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert history[step]["goodput"] == pytest.approx(record["goodput"], rel=1e-12)
    summary = {
        u.key: json.loads(u.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for u in r.summary.update
    }
    assert summary["goodput"] == pytest.approx(logged[6]["goodput"], rel=1e-12)

    # MLflow: one finished run with config.json as parameters and artifact, every record's metrics.
    client = mlflow.MlflowClient(tracking_uri=store.as_uri())
    got = client.get_run(tracking["mlflow"])
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    assert got.data.params["mesh.spec"] == "fsdp=2" and got.data.params["rules.name"] == "fsdp"
    assert json.loads(got.data.params["rules.rules.embed"]) == ["fsdp"]
    losses = {m.step: m.value for m in client.get_metric_history(got.info.run_id, "loss")}
    assert losses == {step: pytest.approx(r["loss"], rel=1e-12) for step, r in logged.items()}
    assert {m.step for m in client.get_metric_history(got.info.run_id, "goodput")} == {2, 4, 6}
    artifacts = {a.path for a in client.list_artifacts(got.info.run_id)}
    assert "config.json" in artifacts and any(a.startswith("config.resumed-") for a in artifacts)


def test_a_backend_that_is_missing_or_cannot_start_is_one_error_before_the_compile(
    tmp_path, devices, monkeypatch
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    cfg = load_config("tiny", [*OVERRIDES, "train.steps=2"])
    setup = assemble(cfg, "fsdp=2", "fsdp", devices=devices[:2])
    with pytest.raises(UserError, match=r"pip install 'spmd-stack\[wandb\]'"):
        run.train(setup, tmp_path / "missing")
    assert not (tmp_path / "missing").exists()  # nothing written
    monkeypatch.undo()

    # An MLflow server that does not answer: the run stops before compiling, with one error.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    unreachable = load_config(
        "tiny",
        [
            *OVERRIDES,
            "train.steps=2",
            "metrics.backends=mlflow",
            "metrics.mlflow_tracking_uri=http://127.0.0.1:9",
        ],
    )
    with pytest.raises(UserError, match="metrics backend mlflow could not start"):
        run.train(assemble(unreachable, "fsdp=2", "fsdp", devices=devices[:2]), tmp_path / "unreachable")
    assert not (tmp_path / "unreachable" / "metrics.jsonl").exists()


def test_backends_are_config_keys_checked_like_any_other():
    assert load_config("tiny").metrics.backends == ("tensorboard",)
    assert load_config("tiny", ["metrics.backends=[wandb, mlflow]"]).metrics.backends == ("wandb", "mlflow")
    with pytest.raises(UserError, match="unknown backend 'neptune'; choose from tensorboard, wandb, mlflow"):
        load_config("tiny", ["metrics.backends=tensorboard,neptune"])
    with pytest.raises(UserError, match="names a backend twice"):
        load_config("tiny", ["metrics.backends=wandb,wandb"])


def test_an_unreachable_mlflow_server_is_an_error_within_its_timeout(tmp_path, devices, monkeypatch):
    import time

    for name in (
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    ):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config("tiny", [*OVERRIDES, "metrics.backends=mlflow", "metrics.mlflow_tracking_uri=http://127.0.0.1:9",
                               "metrics.mlflow_timeout=2", "train.steps=1"])  # fmt: skip
    started = time.perf_counter()
    with pytest.raises(UserError, match="metrics backend mlflow could not start"):
        run.train(assemble(cfg, "", "fsdp", devices=devices[:1]), tmp_path / "run")
    assert time.perf_counter() - started < 60  # its default retries took minutes
