"""Hostile input a user met (found by hostile-input checks): each is one `error:` line, exit code 2, and nothing
written."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A directory of bad files, and a small real run (an imported HF fixture) to point commands at."""
    from spmd.io import hf

    d = tmp_path_factory.mktemp("bad")
    (d / "bad.toml").write_bytes(b"[model]\nd_model = 64 # \xff\xfe\n")
    (d / "badrules.toml").write_bytes(b'extends = "fsdp"\n# \xff\n')
    (d / "prompts.txt").write_bytes(b"hello \xff\n")
    (d / "empty.npy").write_bytes(b"")
    np.save(d / "neg.npy", np.array([1, -3, 5] * 100, np.int32))
    np.save(d / "tokens.npy", np.random.default_rng(0).integers(0, 128, 4000).astype(np.uint16))
    (d / "afile").write_text("x")
    (d / "doc.txt").write_text("a document\n")
    (d / "locked").mkdir()
    (d / "locked" / ".lock").write_text("garbage")
    hf.import_hf(str(FIXTURES / "llama"), str(d / "run"))
    (d / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "yo"}]}) + "\n")  # fmt: skip
    (d / "huge.jinja").write_text("{% for i in range(10**9) %}x{% endfor %}")
    from spmd.data import prepare

    prepare.prepare([str(d / "doc.txt")], str(d / "prepared"), prepare.Options(), progress=False)
    manifest = json.loads((d / "prepared" / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["sha256"] = "not a table"
    del manifest["manifest_sha256"]  # as an older prepare wrote it
    (d / "prepared" / "manifest.json").write_text(json.dumps(manifest))
    # An HF directory whose config contradicts itself, and one whose weights are integers.
    for name in ("hf_foo", "hf_int"):
        shutil.copytree(FIXTURES / "llama", d / name)
    config = json.loads((d / "hf_foo" / "config.json").read_text())
    (d / "hf_foo" / "config.json").write_text(json.dumps({**config, "model_type": "foo"}))
    from safetensors.numpy import load_file, save_file

    weights = load_file(d / "hf_int" / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"].astype(np.int32)
    save_file(weights, d / "hf_int" / "model.safetensors", metadata={"format": "pt"})
    return d


CASES = {
    "config not UTF-8": (
        ["train.py", "--config", "{d}/bad.toml"], "config file '{d}/bad.toml' is not UTF-8 text"),
    "rules not UTF-8": (
        ["train.py", "--config", "tiny", "--rules", "{d}/badrules.toml"], "rules file '{d}/badrules.toml' is not UTF-8"),
    "prompts not UTF-8": (
        ["sample.py", "--run-dir", "{d}/run", "--prompts-file", "{d}/prompts.txt"], "is not UTF-8 text"),
    "empty .npy": (
        ["train.py", "--config", "tiny", "--set", "data.path={d}/empty.npy", "--run-dir", "{d}/r1"],
        "is not a readable .npy array"),
    "negative token ids": (
        ["train.py", "--config", "tiny", "--set", "data.path={d}/neg.npy", "--set", "train.seq_len=8",
         "--run-dir", "{d}/r2"], "negative token id -3"),
    "reshard onto a file": (
        ["ckpt.py", "reshard", "{d}/run", "{d}/afile/x", "--mesh", "fsdp=1", "--rules", "fsdp"],
        "'{d}/afile' is a file"),
    "memory with two dots": (
        ["plan.py", "--config", "tiny", "--devices", "8", "--memory-per-device", "1.2.3GiB"], "must look like 80GiB"),
    "zero peak": (
        ["plan.py", "--config", "tiny", "--devices", "8", "--memory-per-device", "1GiB", "--peak-tflops", "0"],
        "--peak-tflops must be a positive number"),
    "negative peak": (
        ["plan.py", "--config", "tiny", "--devices", "8", "--memory-per-device", "1GiB", "--peak-tflops", "-5"],
        "--peak-tflops must be a positive number"),
    "zero ici": (
        ["plan.py", "--config", "tiny", "--devices", "8", "--memory-per-device", "1GiB", "--ici-gbps", "0"],
        "--ici-gbps must be a positive number"),
    "launch a missing command": (
        ["launch.py", "--processes", "2", "--", "/nonexistent/cmd"], "cannot run '/nonexistent/cmd'"),
    "nan temperature": (
        ["sample.py", "--run-dir", "{d}/run", "--prompt", "w5", "--temperature", "nan"], "--temperature must be >= 0"),
    "more eval batches than held-out data": (
        ["eval.py", "--run-dir", "{d}/run", "--data", "{d}/tokens.npy", "--batches", "100000000"],
        "more than the held-out split holds"),
    # Outputs that cannot be written: one error before any work (a read-only mount answers alike).
    "export-hf to an unwritable place": (
        ["ckpt.py", "export-hf", "{d}/run", "--out", "/proc/spmd-out/hf"], "--out '/proc/spmd-out/hf' cannot be written"),
    "import-hf to an unwritable place": (
        ["ckpt.py", "import-hf", str(FIXTURES / "llama"), "--run-dir", "/proc/spmd-out/run"],
        "--run-dir '/proc/spmd-out/run' cannot be written"),
    "reshard to an unwritable place": (
        ["ckpt.py", "reshard", "{d}/run", "/proc/spmd-out/r", "--mesh", "fsdp=1", "--rules", "fsdp"],
        "reshard destination '/proc/spmd-out/r' cannot be written"),
    "prepare to an unwritable place": (
        ["data.py", "prepare", "{d}/doc.txt", "--out", "/proc/spmd-out/data"], "--out '/proc/spmd-out/data' cannot be"),
    "HF config whose model_type contradicts its architecture": (
        ["ckpt.py", "import-hf", "{d}/hf_foo", "--run-dir", "{d}/r3"], "but model_type is 'foo'"),
    "HF weights that are integers": (
        ["ckpt.py", "import-hf", "{d}/hf_int", "--run-dir", "{d}/r4"], "tensor lm_head.weight holds I32"),
    "plan for zero devices": (
        ["plan.py", "--config", "tiny", "--devices", "0", "--memory-per-device", "1GiB"], "--devices must be at least 1"),
    "a lock file that names no trainer": (
        ["train.py", "--config", "tiny", "--run-dir", "{d}/locked"], "names no trainer"),
    "host devices that are no number": (
        ["dryrun.py", "--config", "tiny", "--host-devices", "many"], "a positive integer is needed"),
    # The third battery's tracebacks and hangs
    "prepare into a directory that takes no files": (
        ["data.py", "prepare", "{d}/doc.txt", "--out", "/proc/self/spmd-data"], "cannot be written"),
    "a Hub id the Hub refuses": (
        ["ckpt.py", "import-hf", "org/name-", "--run-dir", "{d}/r5"], "nor a valid Hugging Face repository id"),
    "lm-eval tasks that name nothing": (["eval.py", "--run-dir", "{d}/run", "--tasks", ","], "names no task"),
    "negative few-shot": (
        ["eval.py", "--run-dir", "{d}/run", "--tasks", "x", "--num-fewshot", "-1"], "--num-fewshot must be >= 0"),
    "a chat template that loops a billion times": (
        ["data.py", "prepare", "{d}/chats.jsonl", "--format", "chat", "--chat-template", "{d}/huge.jinja",
         "--out", "{d}/never"], "failed while rendering (OverflowError"),
    "a manifest whose digests are a string": (
        ["data.py", "verify", "{d}/prepared"], "sha256 entry for train-00000.bin is not a table"),
    "a trillion devices to plan": (
        ["plan.py", "--config", "tiny", "--devices", "1000000000000", "--memory-per-device", "1GiB"],
        "more than the 4096 devices spmd-plan can simulate"),
    "a trillion-token sequence": (
        ["plan.py", "--config", "tiny", "--devices", "8", "--memory-per-device", "1GiB", "--set",
         "train.seq_len=1000000000000"], "train.seq_len must be at most 16,777,216"),
    "a hundred thousand host devices": (
        ["dryrun.py", "--config", "tiny", "--host-devices", "100000"], "at most 4096 simulated devices fit one process"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_error_line(files, case):
    args, expected = CASES[case]
    script, *rest = args
    cmd = [sys.executable, "-m", f"spmd.cli.{script.removesuffix('.py')}", *(a.format(d=files) for a in rest)]
    if script in ("train.py", "sample.py", "eval.py", "ckpt.py"):
        cmd += ["--host-devices", "1"] + (["--mesh", "fsdp=1"] if script in ("sample.py", "eval.py") else [])
    before = sorted(p.name for p in files.iterdir())
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected.format(d=files) in lines[0]
    assert sorted(p.name for p in files.iterdir()) == before  # nothing written


def test_a_bad_host_device_count_in_the_environment_names_it(tmp_path):
    env = {**os.environ, "SPMD_HOST_DEVICES": "abc"}
    cmd = [
        sys.executable,
        "-m",
        "spmd.cli.train",
        "--config",
        "tiny",
        "--run-dir",
        str(tmp_path / "r"),
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: argument --host-devices: a positive integer is needed (from --host-devices or $SPMD_HOST_DEVICES), "
        "got 'abc' (see spmd-train --help)"
    ]
    assert not (tmp_path / "r").exists()


def test_a_cpu_host_with_libtpu_installed_gets_only_the_error_line(tmp_path):
    """No platform named, no accelerator visible, libtpu installed (the `tpu` extra): the command
    runs JAX on the CPU without initialising libtpu, whose warnings about the missing TPU would
    otherwise come before the one `error:` line (this bad rules preset is found once JAX runs)."""
    import os

    from spmd.platform import hostmem

    pytest.importorskip("libtpu")
    if not hostmem.cpu_host(platforms=""):
        pytest.skip("a TPU or GPU is visible: JAX is meant to initialise it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    cmd = [sys.executable, "-m", "spmd.cli.train", "--config", "tiny", "--rules", "nonesuch",
           "--run-dir", str(tmp_path / "run")]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown rules preset 'nonesuch'"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()


def test_launcher_ports_and_signalled_children():
    import socket

    launch = [sys.executable, "-m", "spmd.cli.launch", "--processes", "2"]

    def run(*args):
        return subprocess.run(
            [*launch, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run("--port", str(port), "--", "true")
        assert result.returncode == 2 and result.stderr.startswith(f"error: --port {port} is not free")
    result = run("--port", "99999", "--", "true")
    assert result.returncode == 2 and "--port must be between 1 and 65535" in result.stderr
    result = run("--", "bash", "-c", "kill -9 $$")  # a child killed by SIGKILL: 128 + 9, as a shell says
    assert result.returncode == 137, result.stderr


def test_a_family_module_that_fails_to_import_is_an_error_naming_it(tmp_path, monkeypatch):
    from spmd.core import family
    from spmd.core.errors import UserError

    (tmp_path / "broken_families").mkdir()
    (tmp_path / "broken_families" / "__init__.py").write_text("")
    (tmp_path / "broken_families" / "mine.py").write_text("raise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        UserError, match=r"importing broken_families.mine failed \(RuntimeError: half-written\)"
    ):
        family.find("broken_families.mine")


def test_a_checkpoint_rotated_away_while_read_says_so(files, tmp_path):
    from spmd.core.errors import UserError
    from spmd.io import checkpoint as ckpt

    shutil.copytree(files / "run", tmp_path / "run")
    directory, step = ckpt.locate(str(tmp_path / "run"))
    shutil.rmtree(directory / str(step))  # what a live run's retention does between locate and read
    with pytest.raises(ckpt.Rotated, match="was deleted while being read"):
        ckpt.read_meta(directory, step)
    assert issubclass(ckpt.Rotated, UserError)


def test_a_full_disk_is_an_error_that_leaves_nothing_half_written(files, tmp_path, monkeypatch):
    """Writing shards (spmd-data prepare) or safetensors (export-hf) onto a full disk."""
    import errno

    import safetensors.numpy

    from spmd.core.errors import UserError
    from spmd.data import prepare
    from spmd.io import hf

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare._ShardWriter, "add", full)
    with pytest.raises(
        UserError, match="writing .* failed \\(No space left on device\\); nothing was replaced"
    ):
        prepare.prepare([str(files / "doc.txt")], str(tmp_path / "data"), prepare.Options(), progress=False)
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(UserError, match="writing model.safetensors into .* failed .*No space left"):
        hf.export_hf(str(files / "run"), str(tmp_path / "hf"), mesh="fsdp=8")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporaries
