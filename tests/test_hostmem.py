"""cpu.host_heap (spmd/platform/hostmem.py): freed heap memory kept for reuse (glibc's retained, or
tbbmalloc's through a relaunch), so that an XLA:CPU program's temporaries are not page-faulted in
again on every execution. Each case runs in a fresh process: the switch is process-wide and cannot
be undone."""

import json
import os
import statistics
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, run_fresh

from spmd.assembly.config import load_config
from spmd.core.errors import UserError
from spmd.platform import hostmem

# Steps of `small`'s bf16 train step (171 MiB of temporaries) on one CPU device, as spmd-train
# runs them: page faults of each step, with glibc's malloc as it is and with freed memory retained.
PROBE = textwrap.dedent(
    """
    import json, resource
    import jax
    from spmd.platform import hostmem
    from spmd.assembly.setup import assemble, before_jax_starts

    overrides = ["model.dtype=bfloat16", {override!r}]
    before_jax_starts("small", overrides, may_relaunch=True)  # as spmd-train does
    setup = assemble("small", "", "dp", overrides=overrides)
    state, batch = setup.trainer.init_state(), setup.batches().train_batch(0)
    for _ in range(3):
        state, _ = setup.trainer.train_step(state, batch)
    jax.block_until_ready(state)
    faults = []
    for _ in range({steps}):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        state, _ = setup.trainer.train_step(state, batch)
        jax.block_until_ready(state)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    temp = setup.trainer.train_step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    print(json.dumps({{"faults": faults, "pages": temp / 4096, "heap": hostmem.active()}}))
    """
)


def probe(setting: str, steps: int) -> dict:
    return run_fresh(PROBE.format(override=f"cpu.host_heap={setting}", steps=steps))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retained_heap_stops_the_page_faults_of_each_execution():
    # the system heap faults every step; the retained ones, 24 steps for a median (below)
    system, retain, auto = probe("system", 8), probe("retain", 24), probe("auto", 24)
    pages = system["pages"]  # the step's temporaries, in 4 KiB pages
    assert system["heap"] == "system" and retain["heap"] == "retain"
    # on a CPU host auto relaunches under tbbmalloc where its wheel is installed (x86-64 Linux)
    assert auto["heap"] == ("tbbmalloc" if hostmem.tbbmalloc_libraries() else "retain"), auto
    # glibc maps each execution's temporaries afresh and faults them in page by page ...
    assert statistics.mean(system["faults"]) > 0.9 * pages, system
    # ... unless freed memory stays in the heap: then most steps fault nothing. glibc's heap still
    # grows now and then, when small allocations took part of the freed block: that step (often two
    # in a row) faults a new block in, 0-3 steps of 30 measured, 4 of 8 once; so the median step
    # over 24, not the mean of a few. tbbmalloc keeps large blocks apart from small ones.
    assert statistics.median(retain["faults"]) < 0.01 * pages, retain
    assert statistics.median(auto["faults"]) < 0.01 * pages, auto


# A command run from its command line: the process prints its pid, relaunches itself under
# tbbmalloc (exec: the same pid, the code runs again from the start), then reports.
RELAUNCH_PROBE = textwrap.dedent(
    """
    import json, os, subprocess, sys
    print(json.dumps({"pid": os.getpid()}), flush=True)
    from spmd.platform import hostmem
    from spmd.assembly.setup import before_jax_starts

    before_jax_starts("tiny", [], may_relaunch=sys.argv[1] == "relaunch")
    probe = "import ctypes; print(hasattr(ctypes.CDLL(None), '__TBB_malloc_proxy'))"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "pid": os.getpid(), "heap": hostmem.active(), "preload": os.environ.get("LD_PRELOAD"),
        "marked": hostmem.RELAUNCHED in os.environ, "child_tbbmalloc": child,
    }))
    """
)


@pytest.mark.skipif(hostmem.tbbmalloc_libraries() is None, reason="the tbb wheel (x86-64 Linux)")
@pytest.mark.parametrize("mode", ["relaunch", "library call"])
def test_a_command_relaunches_itself_under_tbbmalloc(mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "LD_PRELOAD"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", RELAUNCH_PROBE, mode], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    *starts, report = lines
    if mode == "library call":  # a process that was not started as a command keeps running
        assert len(starts) == 1 and report["heap"] == "retain", lines
        return
    # ran twice from the start in one process (exec), now under tbbmalloc ...
    assert len(starts) == 2 and starts[0]["pid"] == starts[1]["pid"] == report["pid"], lines
    assert report["heap"] == "tbbmalloc", report
    # ... with the environment its children see as it was: they start under glibc's malloc
    assert report["preload"] is None and not report["marked"], report
    assert report["child_tbbmalloc"] == "False", report


def test_cpu_host(monkeypatch):
    from jax._src import hardware_utils

    assert hostmem.cpu_host("cpu") and not hostmem.cpu_host("cuda,cpu") and not hostmem.cpu_host("tpu")
    for probe_name in ("has_visible_nvidia_gpu", "num_available_amd_gpus"):
        monkeypatch.setattr(hardware_utils, probe_name, lambda *a, **k: 0)
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    assert hostmem.cpu_host("")  # no platform named, no accelerator visible: the CPU
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (4, "v5e"))
    assert not hostmem.cpu_host("")
    monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
    monkeypatch.setattr(hardware_utils, "has_visible_nvidia_gpu", lambda: True)
    assert not hostmem.cpu_host("")


# A free top of the heap larger than 2 GiB: glibc trims it back to the system at the free unless
# trimming is off, and the next block of that size is page-faulted in again.
TRIM_PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util, json, resource
    from spmd.platform import hostmem

    assert hostmem.retain_freed_memory()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    size = 9 * 2**28  # 2.25 GiB
    def touch():
        block = libc.malloc(size)
        assert block
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ctypes.memset(block, 1, size)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        libc.free(block)
        return faults
    first, again = touch(), touch()
    print(json.dumps({"first": first, "again": again, "pages": size / 4096}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retained_heap_keeps_a_free_top_larger_than_2_gib():
    """The heap's free top is never trimmed, however large: mallopt's largest positive threshold
    (2**31 - 1) still trimmed above 2 GiB, so a train step with more temporaries than that left
    free at the top (d 512 / 8 layers / T 512 fp32: 1.2 GiB of temporaries, plus the freed state)
    faulted them in again every few steps."""
    faults = run_fresh(TRIM_PROBE)
    assert faults["first"] > 0.9 * faults["pages"], faults  # the probe does fault fresh memory in
    assert faults["again"] < 0.01 * faults["pages"], faults  # and the freed block was kept


def test_host_heap_choices(monkeypatch):
    choose = hostmem.choose
    assert choose("auto", on_cpu=True, tbbmalloc_ok=True) == "tbbmalloc"
    assert choose("auto", on_cpu=True, tbbmalloc_ok=False) == "retain"
    assert choose("auto", on_cpu=False, tbbmalloc_ok=True) == "system"
    assert choose("tbbmalloc", on_cpu=False, tbbmalloc_ok=True) == "tbbmalloc"
    assert choose("tbbmalloc", on_cpu=True, tbbmalloc_ok=False) == "retain"  # cannot relaunch
    assert choose("retain", on_cpu=False, tbbmalloc_ok=True) == "retain"
    assert choose("system", on_cpu=True, tbbmalloc_ok=True) == "system"
    assert hostmem.wanted("auto", on_cpu=True) and not hostmem.wanted("auto", on_cpu=False)
    assert hostmem.wanted("retain", on_cpu=False) and not hostmem.wanted("system", on_cpu=True)
    with pytest.raises(UserError, match="cpu.host_heap must be one of auto, tbbmalloc, retain, system"):
        load_config("tiny", ["cpu.host_heap=mmap"])
    # asked for by name where the wheel is missing: a clear error, before anything changes
    monkeypatch.setattr(hostmem, "tbbmalloc_libraries", lambda: None)
    with pytest.raises(UserError, match="cpu.host_heap=tbbmalloc needs Intel's tbb wheel"):
        hostmem.prepare("tbbmalloc", may_relaunch=True)


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_commands_that_load_a_checkpoint_set_the_heap_before_jax_starts(command, monkeypatch):
    """spmd-sample and spmd-eval learn their config from the checkpoint once JAX runs, so they set
    cpu.host_heap's default first (config None), relaunching only from their command line."""
    import importlib

    from spmd.assembly import setup

    module = importlib.import_module(f"spmd.cli.{command}")
    calls = []

    class Stop(Exception):
        pass

    def record(config, overrides=(), *, may_relaunch=False):
        calls.append((config, may_relaunch))
        raise Stop

    original = setup.before_jax_starts
    monkeypatch.setattr(setup, "before_jax_starts", record)
    monkeypatch.setattr(sys, "argv", [f"spmd-{command}", "--run-dir", "nowhere"])
    for argv, relaunch in ((["--run-dir", "nowhere"], False), (None, True)):
        with pytest.raises(Stop):
            module.main(argv)
        assert calls[-1] == (None, relaunch)
    assert len(calls) == 2
    prepared = []
    monkeypatch.setattr(
        hostmem, "prepare", lambda setting, may_relaunch: prepared.append((setting, may_relaunch))
    )
    original(None, may_relaunch=True)
    assert prepared == [(load_config("tiny").cpu.host_heap, True)] and prepared[0][0] == "auto"
