"""spmd-plan on a toy budget: tiny on 8 devices with too little memory for data parallelism."""

import pytest
from test_inference import run_script

from spmd.assembly.planner import parse_bytes


def test_picks_a_layout_that_fits_and_rejects_dp_with_the_reason():
    r = run_script(
        "plan",
        "--config",
        "tiny",
        "--devices",
        "8",
        "--memory-per-device",
        "3MiB",
        "--hardware",
        "cpu",
        "--candidates",
        "2",
        # data and tensor only: dp (rejected once compiled), tp, its variants and the kv-head
        # rejection are all in this space, at 5 compiles instead of the full search's 8
        "--axes",
        "data,tensor",
    )
    assert r.returncode == 0, r.stderr
    best = [line for line in r.stdout.splitlines() if line.startswith("  1. ")]
    assert best and "needs" in best[0] and "of 3.00 MiB" in best[0]
    assert "--rules dp" not in best[0]  # replicated parameters: the slowest to fit, if at all
    # kv_heads = 2 cannot split over tensor = 8: rejected with the reason, not silently skipped.
    assert "--mesh tensor=8 --rules tp: layers/attn/wk_DKH: dimension 2 (kv_heads, size 2)" in r.stdout
    # Every answer with the command that runs it, and the batch it was planned for.
    lines = r.stdout.splitlines()
    runs = [line for line in lines if line.startswith("     run: ")]
    assert len(runs) == len([line for line in lines if line[:5] in ("  1. ", "  2. ")])
    mesh = best[0].split("--mesh ")[1].split(" ")[0]
    assert (
        runs[0]
        == f"     run: spmd-train --config tiny --mesh {mesh} --rules {best[0].split('--rules ')[1].split(':')[0]}"
    )
    assert "planned for: global batch 8 x 64 tokens" in r.stdout, r.stdout


def test_goes_down_the_ranking_until_enough_fit_once_compiled():
    args = [
        "plan",
        "--config",
        "tiny",
        "--devices",
        "8",
        "--memory-per-device",
        "3MiB",
        "--hardware",
        "cpu",
        "--candidates",
        "2",
    ]
    r = run_script(*args)
    assert r.returncode == 0, r.stderr
    # Some of the fastest layouts fit by analytic memory (no activations) but not once compiled; they
    # take a memory lever (and say why, with the compiled figure) or are rejected with it, and the
    # planner compiles further until two fit.
    lines = r.stdout.splitlines()
    took = [
        i
        for i, line in enumerate(lines)
        if line.startswith("  ") and " --set " in line and ". --mesh" in line
    ]
    assert took and all(lines[i + 1].startswith("     why: as given the compiled step needed") for i in took)
    assert all(
        lines[i + 2].startswith("     run: spmd-train --config tiny --mesh ") and "--set" in lines[i + 2]
        for i in took
    )
    assert all("> budget 3.00 MiB" in line for line in lines if "compiled step needs" in line)
    assert "  2. --mesh" in r.stdout and "  3. --mesh" not in r.stdout
    capped = run_script(*args, "--max-compiles", "1")
    assert "raise --candidates or --max-compiles" in capped.stdout and "  2. --mesh" not in capped.stdout


def test_searches_expert_and_context_axes():
    r = run_script(
        "plan",
        "--config",
        "tiny-moe",
        "--devices",
        "8",
        "--memory-per-device",
        "1GiB",
        "--hardware",
        "cpu",
        "--axes",
        "data,context,expert",
        "--candidates",
        "2",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    best = [line for line in lines if line.startswith(("  1. ", "  2. "))]
    # Expert parallelism moves tokens, not parameters: with this little compute it ranks first.
    assert len(best) == 2 and all("--rules ep:" in line and "expert=" in line for line in best)
    assert "--mesh context=8 --rules cp_ulysses: ulysses context parallelism over context=8" in r.stdout
    assert "(7 more fit by analytic memory" in r.stdout  # cp_ring, dp_zero1 and the rest of ep
    assert not any("fsdp=" in line or "tensor=" in line for line in lines)  # only the axes asked for
    bad = run_script(
        "plan", "--config", "tiny", "--devices", "8", "--memory-per-device", "1GiB", "--axes", "data,pipe"
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: --axes: unknown mesh axis pipe")


def test_bad_budget_is_an_error():
    r = run_script("plan", "--config", "tiny", "--devices", "8", "--memory-per-device", "lots")
    assert r.returncode == 2 and r.stderr.startswith("error: --memory-per-device must look like 80GiB")


@pytest.mark.parametrize(
    "text,value", [("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("3MB", 3 * 2**20), ("100", 100)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_one_hardware_table_serves_mfu_and_the_planner():
    from spmd.analysis.hardware import chip_for, planner_chips
    from spmd.assembly.planner import hardware

    assert chip_for("NVIDIA H100 80GB HBM3")[0] == "h100" and chip_for("TPU v5 lite")[0] == "tpu-v5e"
    assert chip_for("cpu") is None  # a CPU's peak is measured, never looked up
    assert {"h100", "a100", "tpu-v5p"} <= set(planner_chips()) and "l4" not in planner_chips()
    assert hardware("h100", ici_gbps=100) == {"peak": 989e12, "ici": 100e9, "dcn": 50e9}


def test_candidate_presets_come_from_the_preset_files():
    """Which presets the planner tries on a mesh is read from the rules files: the axes each maps
    something other than the batch to, one preset per distinct layout (the simplest), none that
    says `plan = false`."""
    from spmd.assembly.planner import candidate_presets
    from spmd.core.rules import load_rules, presets

    rules = {p: load_rules(p) for p in presets()}
    assert candidate_presets({"fsdp": 8}, rules) == ["fsdp"]  # fsdp_tp there is fsdp
    assert candidate_presets({"data": 8}, rules) == ["dp", "dp_zero1"]
    assert set(candidate_presets({"expert": 8}, rules)) == {"ep"}  # fsdp_ep there is ep
    assert "pp_fsdp_tp" in candidate_presets({"stage": 2, "tensor": 4}, rules)  # pipeline x tensor
    context = candidate_presets({"context": 8}, rules)
    assert {"cp_ring", "cp_ulysses"} <= set(context) and "allgather" not in context
    assert all("base" not in candidate_presets(s, rules) for s in ({"data": 8}, {"fsdp": 8}, {"data": 1}))


def test_a_layout_that_does_not_fit_as_given_takes_the_memory_levers(devices):
    """Where the compiled step needs more than the budget, the planner tries remat and
    microbatches (the cheapest its measured activations say will fit, compiled again to check)
    and says which it took and why; the answer's peak is the compiled one of those settings."""
    from spmd.assembly.config import load_config
    from spmd.assembly.planner import hardware, search

    cfg = load_config("small", ["train.seq_len=1024", "train.global_batch_size=32"])
    budget = 300 * 2**20  # as given, fsdp=8 needs ~430 MiB; 2 microbatches ~230 MiB
    found = search(cfg, 8, budget, hardware("h100"), axes=("fsdp",), candidates=1, max_compiles=4)
    (best,) = found.ranked
    assert best["mesh"] == "fsdp=8" and best["need"] <= budget
    assert any(lv.startswith("train.microbatches=") for lv in best["levers"]), best["levers"]
    assert best["setup"].cfg.train.microbatches > 1
    assert "as given the compiled step needed" in best["why"]


def test_gpu_clusters_are_planned_by_host_with_the_command_to_run():
    """GPUs come 8 to a host (--hardware h100): 16 devices are 2 hosts, the outermost axes' shares
    cross them, ranked by the analytic bytes of what NCCL runs, and the command to run puts those
    shares in --dcn-mesh."""
    from spmd.assembly.planner import command
    from spmd.core.mesh import split_over_hosts

    assert split_over_hosts({"data": 8, "fsdp": 32}, 32) == (
        {"data": 8, "fsdp": 4},
        {"data": 1, "fsdp": 8},
        1,
    )
    assert split_over_hosts({"tensor": 4}, 2) == ({"tensor": 2}, {"tensor": 2}, 1)
    assert split_over_hosts({"data": 3}, 2) == ({}, {"data": 3}, 2)
    assert command("tiny", "data=3", "dp", [], 2) == "spmd-train --config tiny --mesh data=3 --rules dp"
    assert command("llama-70b", "data=8,fsdp=32", "fsdp", ["train.global_batch_size=64"], 32) == (
        "spmd-train --config llama-70b --dcn-mesh data=8,fsdp=4 --mesh fsdp=8 --rules fsdp "
        "--set train.global_batch_size=64"
    )
    assert command("tiny", "fsdp=8", "fsdp", [], 1) == "spmd-train --config tiny --mesh fsdp=8 --rules fsdp"
    r = run_script("plan", "--config", "tiny", "--devices", "16", "--memory-per-device", "80GiB", "--hardware",
                   "h100", "--axes", "data,fsdp", "--candidates", "1", "--host-devices", "16",
                   "--set", "train.global_batch_size=16")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (
        "2 host(s), 8 per host" in r.stdout and "the analytic bytes of the collectives NCCL runs" in r.stdout
    )
    (run,) = [line for line in r.stdout.splitlines() if line.startswith("     run: ")]
    assert run.startswith("     run: spmd-train --config tiny --dcn-mesh ") and "DCN axes" in r.stdout
    assert run.endswith(" --set train.global_batch_size=16")
    for flags, message in (
        (("--devices", "12"), "--devices 12 is not a whole number of hosts of 8 GPUs"),
        (("--devices", "16", "--dcn", "4", "--gpus-per-host", "8"), "--dcn 4 hosts x --gpus-per-host 8 is not --devices 16"),
    ):  # fmt: skip
        bad = run_script(
            "plan", "--config", "tiny", "--memory-per-device", "80GiB", "--hardware", "h100", *flags
        )
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {message}"), bad.stderr


def test_a_dry_run_gives_a_verdict_against_a_memory_budget():
    """spmd-dryrun --memory-per-device: fits, or over by how much with the levers the planner
    would take (the cheapest remat x microbatches its activations say will fit)."""
    import json

    r = run_script("dryrun", "--config", "tiny", "--mesh", "fsdp=8", "--rules", "fsdp", "--json",
                   "--memory-per-device", "1MiB", "--set", "model.remat=none", "--host-devices", "8")  # fmt: skip
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)["verdict"]
    assert not v["fits"] and v["over"] == v["need"] - 2**20 > 0
    assert v["levers"] and all(
        lv.split("=")[0] in ("model.remat", "train.microbatches") for lv in v["levers"]
    )
    from spmd.assembly.config import load_config
    from spmd.assembly.planner import verdict

    report = json.loads(r.stdout)
    roomy = verdict(load_config("tiny", ["model.remat=none"]), report, 2**30)
    assert roomy["fits"] and roomy["levers"] == [] and roomy["over"] == 0


def test_pipelines_are_offered_with_scheduled_backwards_and_win_only_over_slow_links():
    """Over stage and fsdp: on one host FSDP ranks first; with the devices on two hosts (slow DCN),
    a pipeline with its stages across the hosts does, as ZB-H1 with more microbatches than GPipe
    could hold (its memory flat in M, its bubble smaller than 1F1B's), and says so."""
    args = ["plan", "--config", "tiny", "--devices", "8", "--memory-per-device", "64MiB", "--hardware", "cpu",
            "--axes", "stage,fsdp", "--set", "model.n_layers=8", "--set", "train.global_batch_size=128",
            "--candidates", "1"]  # fmt: skip
    best = {}
    for dcn in (1, 2):
        r = run_script(*args, "--dcn", str(dcn))
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        best[dcn] = next(i for i, line in enumerate(lines) if line.startswith("  1. ")), lines
    i, lines = best[1]
    assert lines[i].startswith("  1. --mesh fsdp=8 --rules fsdp")
    i, lines = best[2]
    assert lines[i].startswith(
        "  1. --mesh stage=2,fsdp=4 --rules pp_fsdp --set pipeline.schedule=zb_h1 --set pipeline.microbatches=16"
    )
    assert "DCN axes stage" in lines[i]
    assert lines[i + 1] == (
        "     why: zb_h1 runs one pass per stage and tick (forward, input or weight gradient), idling a third "
        "of what 1f1b does, and holds at most 2 microbatches per stage whatever M, so M = 16: bubble 2.0% "
        "(1f1b's 5.9%; GPipe at M = 2: 33.3%)"
    )
    assert lines[i + 2].startswith(
        "     run: spmd-train --config tiny --dcn-mesh stage=2 --mesh fsdp=4 --rules pp_fsdp"
    )


# tiny-moe with 6 layers, an MoE layer every third, scans 2 groups of 3 (its dense layers in a stack
# of 4): 2 groups do not split into 2 S = 4.
@pytest.mark.parametrize(
    "config,layers,offered", [("tiny", 8, True), ("tiny", 2, False), ("tiny-moe", 6, False)]
)
def test_planner_offers_interleaved_zb_where_each_stage_holds_two_layer_groups(
    devices, config, layers, offered
):
    """Beside 1f1b and zb_h1, interleaved_zb with 2 repeats where the layer groups split into 2 S:
    half zb_h1's idle time (a sixth of 1f1b's)."""
    from spmd.assembly.planner import schedule_offers
    from spmd.assembly.setup import assemble

    setup = assemble(config, "stage=2,fsdp=4", "pp_fsdp", devices=devices,
                     overrides=[f"model.n_layers={layers}", "train.global_batch_size=128",
                                *(["moe.every=3"] if config == "tiny-moe" else [])])  # fmt: skip
    offers = {tuple(o): why for o, why in schedule_offers(setup)}
    assert ("pipeline.schedule=zb_h1", "pipeline.microbatches=16") in offers
    izb = ("pipeline.schedule=interleaved_zb", "pipeline.repeats=2", "pipeline.microbatches=16")
    assert (izb in offers) == offered
    if offered:  # S = 2, M = 16: (S - 1) / (3 M R + S - 1) = 1 / 97, zb_h1's (S - 1) / (3 M + S - 1)
        assert "bubble 1.0% (zb_h1's 2.0%, 1f1b's 5.9%)" in offers[izb]
