"""Pipeline parallelism over `stage` (spmd/parallel/pipeline.py, scheduled.py): GPipe, circular, 1F1B
and interleaved 1F1B train like one device, checkpoints move in and out of a pipeline in canonical
layer order, and the compiled step sends, computes and holds what the schedule says."""

import collections
import json
import math
import pathlib

import jax
import numpy as np
import pytest
from conftest import run_training
from test_cli import spmd_train

from spmd.analysis.aot import dry_run, estimate
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.rules import load_rules
from spmd.parallel.pipeline import layer_order

DEEP = ["model.n_layers=8"]
RULES = pathlib.Path(__file__).parent / "fixtures" / "rules"
INTERLEAVED_ZB = ["pipeline.schedule=interleaved_zb", "pipeline.repeats=2"]


def _n_devices(mesh: str) -> int:
    return math.prod(int(part.split("=")[1]) for part in mesh.split(",") if part)


@pytest.fixture(scope="module")
def deep_single(devices):
    """`tiny` with 8 layers, 10 steps on one device."""
    return run_training(load_config("tiny", DEEP), "", "fsdp", 10, devices[:1])


LAYOUTS = [
    ("pp", "stage=4", ["pipeline.microbatches=8"]),
    ("pp_fsdp_tp", "stage=2,fsdp=2,tensor=2", ["pipeline.gather_once=true", "pipeline.microbatches=4"]),
    # Circular: each of 4 stages holds 2 non-adjacent layers (stored permuted); with remat.
    (
        "pp",
        "stage=4,data=2",
        ["pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=4", "model.remat=full"],
    ),  # fmt: skip
    # Inside gradient accumulation: 2 accumulation microbatches, each piped as 2.
    ("pp_fsdp", "stage=2,fsdp=2", ["pipeline.microbatches=2", "train.microbatches=2"]),
]


@pytest.mark.parametrize(
    "rules,mesh,overrides", LAYOUTS, ids=[f"{pathlib.Path(r).stem}-{m}-{o[0]}" for r, m, o in LAYOUTS]
)
def test_pipeline_trains_like_one_device(deep_single, devices, rules, mesh, overrides):
    ref_losses, ref_params, _ = deep_single
    cfg = load_config("tiny", DEEP + overrides)
    losses, params, trainer = run_training(cfg, mesh, rules, 10, devices[: _n_devices(mesh)])
    assert trainer.plan.schedule is not None and trainer.plan.schedule.stages == int(mesh.split(",")[0][6:])
    assert losses[-1] < losses[0] - 0.5, "tiny should learn within 10 steps"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    params = trainer.plan.to_canonical(params)  # stored permuted under the circular schedule
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def moe_single(devices):
    """`tiny-moe` (4 layers, dropless experts) on one device with 2 accumulation microbatches."""
    cfg = load_config("tiny-moe", ["model.n_layers=4", "moe.dispatch=dropless", "train.microbatches=2"])
    return run_training(cfg, "", "fsdp", 10, devices[:1])


MOE_LAYOUTS = [
    ("pp_fsdp", "stage=2,fsdp=4", []),
    # the experts split over expert (the dropless all-to-all inside a stage; under the scheduled
    # backward: test_stages_that_diverge_train_like_one_device's moe-expert cases)
    (str(RULES / "pp_fsdp_ep.toml"), "stage=2,expert=2,fsdp=2", []),
]


@pytest.mark.parametrize("rules,mesh,overrides", MOE_LAYOUTS, ids=["gpipe-fsdp", "gpipe-expert"])
def test_moe_pipeline_trains_like_gradient_accumulation_on_one_device(
    moe_single, devices, rules, mesh, overrides
):
    """An MoE model's pipeline microbatches route (and balance) their tokens apart, as gradient
    accumulation's do: the reference is one device with train.microbatches = M (under a scheduled
    backward, where the auxiliary losses' gradient enters every microbatch's backward inside the
    schedule: the moe-expert cases of test_stages_that_diverge_train_like_one_device)."""
    ref_losses, ref_params, _ = moe_single
    cfg = load_config(
        "tiny-moe", ["model.n_layers=4", "moe.dispatch=dropless", "pipeline.microbatches=2", *overrides]
    )
    losses, params, trainer = run_training(cfg, mesh, rules, 10, devices)
    assert trainer.plan.schedule.stages == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


TABLES = [(2, 2, 1), (2, 5, 1), (3, 3, 1), (4, 4, 1), (4, 8, 1), (4, 32, 1), (8, 16, 1), (16, 64, 1),
          (2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (3, 6, 3), (8, 16, 2)]  # fmt: skip


# (mode, S, M, R): every shape for each mode, and fill-and-drain (GPipe, circular) where M is not
# a multiple of S too
TABLE_CASES = [(mode, *shape) for mode in ("zero_bubble", "1f1b", "fill") for shape in TABLES] + [
    ("fill", 4, 5, 2), ("fill", 3, 4, 2)
]  # fmt: skip


@pytest.mark.parametrize("mode,S,M,R", TABLE_CASES, ids=[f"{c}-S{s}-M{m}-R{r}" for c, s, m, r in TABLE_CASES])
def test_diverging_tables_run_every_pass_once_in_order_and_idle_what_the_bubble_says(mode, S, M, R):
    """diverging.table: zero-bubble (split) in 3 R M + S - 1 ticks, each stage running F, B and W
    of every microbatch chunk once, idle S - 1 ticks; 1F1B and fill-and-drain (GPipe, circular) in
    2 (R M + S - 1) ticks, F and a whole backward (BW) each, idle 2 (S - 1). Each pass in its
    stage's order, B after its F and after the next virtual stage's B, W after B, F after the
    previous virtual stage's F (each in an earlier tick); what arrives is what the neighbour's pass
    sent; no ring slot holds two values at once."""
    from spmd.parallel import diverging as dv

    split, fill = mode == "zero_bubble", mode == "fill"
    t = dv.table(S, M, split, R, fill)
    F, B, W = dv.FORWARD, dv.INPUT_GRAD, dv.WEIGHT_GRAD
    if split:
        assert t.ticks == 3 * R * M + S - 1 and t.idle() == S - 1 and t.passes == 3
    else:
        assert t.ticks == 2 * (R * M + S - 1) and t.idle() == 2 * (S - 1) and t.passes == 2
    fo, bo = dv.forward_order(S, M, R, fill), dv.backward_order(S, M, R, fill)
    assert sorted(fo) == sorted(bo) == [(m, r) for m in range(M) for r in range(R)]
    when = {}
    for s in range(S):
        for tick in range(t.ticks):
            kind = int(t.kind[s, tick])
            if kind != dv.IDLE:
                m, r = int(t.microbatch[s, tick]), int(t.chunk[s, tick])
                assert (t.forward_index[s, tick], t.backward_index[s, tick]) == (
                    fo.index((m, r)),
                    bo.index((m, r)),
                )
                for k in (B, W) if kind == dv.BACKWARD else (kind,):
                    assert (k, s, m, r) not in when
                    when[k, s, m, r] = tick
    assert len(when) == 3 * S * M * R
    held = {"residual": [], "saved": [], "input": [], "cotangent": []}  # (stage, slot, from, to)

    def arrivals(arrives):
        return [[x for x in row if x >= 0] for row in arrives]

    for s in range(S):
        for k, order in ((F, fo), (B, bo), (W, bo)):
            assert [when[k, s, m, r] for m, r in order] == sorted(when[k, s, m, r] for m, r in order)
        for m in range(M):
            for r in range(R):
                assert when[F, s, m, r] < when[B, s, m, r] <= when[W, s, m, r]
                assert (when[B, s, m, r] < when[W, s, m, r]) == split
                if (r, s) != (0, 0):  # the previous virtual stage's F sent this one's input
                    p, pr = (s - 1) % S, r - (s == 0)
                    assert when[F, p, m, pr] < when[F, s, m, r]
                    # into the slot this stage's F reads
                    assert t.arrives_forward[s, when[F, p, m, pr]] == t.input_slot[s, when[F, s, m, r]]
                    held["input"].append(
                        (s, t.input_slot[s, when[F, s, m, r]], when[F, p, m, pr], when[F, s, m, r])
                    )
                if (r, s) != (R - 1, S - 1):  # the next virtual stage's B sent this one's cotangent
                    n, nr = (s + 1) % S, r + (s == S - 1)
                    assert when[B, n, m, nr] < when[B, s, m, r]
                    assert t.arrives_backward[s, when[B, n, m, nr]] == t.cotangent_slot[s, when[B, s, m, r]]
                    held["cotangent"].append(
                        (s, t.cotangent_slot[s, when[B, s, m, r]], when[B, n, m, nr], when[B, s, m, r])
                    )
                else:  # the loss's, written by F where B reads it
                    assert t.cotangent_slot[s, when[F, s, m, r]] == t.cotangent_slot[s, when[B, s, m, r]]
                    held["cotangent"].append(
                        (s, t.cotangent_slot[s, when[F, s, m, r]], when[F, s, m, r], when[B, s, m, r])
                    )
                # a chunk's residuals (and W's operands) stay in one slot from F (B) to W
                slot = {k: t.residual_slot[s, when[k, s, m, r]] for k in (F, B, W)}
                assert len(set(slot.values())) == 1
                held["residual"].append((s, slot[F], when[F, s, m, r], when[W, s, m, r]))
                if split:
                    assert t.saved_slot[s, when[B, s, m, r]] == t.saved_slot[s, when[W, s, m, r]]
                    held["saved"].append(
                        (s, t.saved_slot[s, when[B, s, m, r]], when[B, s, m, r], when[W, s, m, r])
                    )
    assert sum(len(v) for v in arrivals(t.arrives_forward)) == sum(
        len(v) for v in arrivals(t.arrives_backward)
    )
    for ring, length in (("residual", t.residual_slots), ("saved", t.saved_slots), ("input", t.input_slots),
                         ("cotangent", t.cotangent_slots)):  # fmt: skip
        values = held[ring]
        if not split and ring == "saved":
            assert not values and length == 0
            continue
        # no two values held at once (from tick a to tick b, both counted) share a slot; the ring
        # is no longer than the most held at once on a stage
        assert all(0 <= k < length for _, k, _, _ in values)
        for i, (s1, k1, a1, b1) in enumerate(values):
            assert not any(
                s1 == s2 and k1 == k2 and a1 <= b2 and a2 <= b1 for s2, k2, a2, b2 in values[i + 1 :]
            )
        most = max(
            sum(a <= x <= b for s2, _, a, b in values if s2 == s) for s in range(S) for x in range(t.ticks)
        )
        assert length == max(most, 1), ring
    if split:
        assert t.saved_slots <= S  # W's operands: as many as ZB-H1 holds, interleaved or not
    if fill:  # every forward of a stage before its first backward: all R M chunks held, as GPipe
        for s in range(S):
            assert max(when[F, s, m, r] for m in range(M) for r in range(R)) < min(
                when[B, s, m, r] for m in range(M) for r in range(R)
            )
        assert t.residual_slots == R * M
    elif R == 1:  # 1F1B's: S in flight on stage 0, whatever M; ZB-H1's at most S + 3
        assert t.residual_slots == (min(S, M) if not split else t.residual_slots) <= S + 3
    else:  # chunk-sized: interleaved 1F1B's warm-up at most 2 R S - 1, interleaved_zb's R S
        assert t.residual_slots <= (R * S if split else 2 * R * S - 1)


# The scheduled pipelines, whose stages run different passes (and so different collectives) in the
# same tick: each layout in a fresh process with JAX's runtime started (gloo collectives, as spmd-train starts them
# on CPU), against one device in the same process. (model, rules, mesh, overrides, reference
# overrides or None for the same model settings, steps)
DIVERGED = {
    # the backward cut into input and weight gradients through FSDP and tensor-parallel matmuls
    # and remat regions; the embedding and the head inside the stages' region
    "fsdp-tp": ("tiny", "pp_fsdp_tp", "stage=2,fsdp=2,tensor=2", [*DEEP, "pipeline.microbatches=4", "model.remat=save_dots"], None, 10),
    # the residual stream split over tensor along the sequence, inside gradient accumulation
    "fsdp-tp-sp-accumulated": ("tiny", "pp_fsdp_tp_sp", "stage=2,fsdp=2,tensor=2",
                               [*DEEP, "pipeline.microbatches=2", "train.microbatches=2", "model.remat=full"], None, 10),
    # ring attention's permutes over context in one stage's forward beside another's backward
    "ring": ("tiny", str(RULES / "pp_cp_ring.toml"), "stage=2,context=2", [*DEEP, "pipeline.microbatches=2", "model.remat=full"], None, 10),
    # four stages (a table with idle ticks in the middle), data parallel beside them
    "four-stages": ("tiny", "pp", "stage=4,data=2", [*DEEP, "pipeline.microbatches=4"], None, 10),
    # the dropless MoE's all-to-all over expert; the reference accumulates M microbatches, which
    # route and balance apart as the pipeline's do
    "moe-expert": ("tiny-moe", str(RULES / "pp_fsdp_ep.toml"), "stage=2,expert=2,fsdp=2",
                   ["model.n_layers=4", "moe.dispatch=dropless", "pipeline.microbatches=2"],
                   ["model.n_layers=4", "moe.dispatch=dropless", "train.microbatches=2"], 10),
    # ZeRO-1 (the optimizer state split over data) under gradient accumulation
    "zero1": ("tiny", str(RULES / "pp_zero1.toml"), "stage=2,data=2",
              [*DEEP, "pipeline.microbatches=2", "train.microbatches=2"], None, 10),
    # LoRA: the weight pass computes the adapters' gradients alone
    "lora": ("tiny", "pp", "stage=2", ["lora.rank=4", "lora.alpha=8", "optimizer.learning_rate=1e-2", "pipeline.microbatches=2"], None, 3),
}  # fmt: skip

_DIVERGED_RUN = """
import json, sys
import numpy as np
from spmd.platform import distributed
distributed.initialize(diverging_collectives=True)
import jax
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble

schedule, model, rules, mesh, n, overrides, reference, steps = json.loads(sys.argv[1])

def train(cfg, mesh, rules, devices):
    setup = assemble(cfg, mesh, rules, devices=devices)
    trainer, batches = setup.trainer, setup.batches()
    state, losses = trainer.init_state(), []
    for step in range(steps):
        state, metrics = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(metrics["loss"]))
    return losses, trainer.plan.to_canonical(jax.device_get(state["params"])), trainer

ref, ref_params, _ = train(load_config(model, reference), "", "fsdp", jax.devices()[:1])
losses, params, trainer = train(load_config(model, [f"pipeline.schedule={schedule}", *overrides]), mesh, rules,
                                jax.devices()[:n])
failing = [jax.tree_util.keystr(path) for (path, a), b in
           zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params))
           if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)]
print(json.dumps({"schedule": trainer.plan.schedule.name, "diverge": trainer.plan.schedule.scheduled,
                  "stages": trainer.plan.schedule.stages, "losses": losses, "reference": ref,
                  "failing": failing, "gloo": jax.config.jax_cpu_collectives_implementation}))
"""


# 1F1B's whole backward where ZB-H1 splits it: through FSDP x tensor, ring attention, the MoE's
# all-to-all, ZeRO-1 under accumulation and LoRA; interleaved (two chunks per stage, stored
# permuted): each remat policy, four stages, ring attention, ZeRO-1, LoRA's weight pass computing the
# adapters' gradients alone; GPipe's and circular's fill-and-drain tables. (schedule, case,
# overrides added to the case's)
REPEATS = ["pipeline.repeats=2"]
DIVERGED_CASES = [("zb_h1", case, []) for case in DIVERGED] + [
    ("1f1b", case, []) for case in ("fsdp-tp", "ring", "moe-expert", "zero1", "lora")
] + [
    ("interleaved_zb", "fsdp-tp", [*REPEATS, "model.remat=full"]),
    ("interleaved_1f1b", "four-stages", [*REPEATS, "model.remat=save_dots"]),
    ("interleaved_1f1b", "ring", REPEATS),
    ("interleaved_1f1b", "zero1", REPEATS),
    ("interleaved_zb", "lora", [*REPEATS, "model.n_layers=4"]),
] + [  # GPipe and circular, scheduled where gloo lets the stages diverge (pipeline.backward=auto)
    ("gpipe", "fsdp-tp", []),
    ("gpipe", "moe-expert", []),
    ("gpipe", "lora", []),
    ("circular", "four-stages", [*REPEATS, "model.remat=full"]),
    ("circular", "ring", REPEATS),
]  # fmt: skip


@pytest.mark.parametrize(
    "schedule,case,extra", DIVERGED_CASES, ids=[f"{s}-{c}" for s, c, _ in DIVERGED_CASES]
)
def test_stages_that_diverge_train_like_one_device(schedule, case, extra):
    import os
    import subprocess
    import sys

    model, rules, mesh, overrides, reference, steps = DIVERGED[case]
    overrides = [*overrides, *extra]
    reference = (
        reference if reference is not None else [o for o in overrides if not o.startswith("pipeline.")]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(
        JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", PYTHONPATH=str(pathlib.Path(__file__).parent.parent)
    )
    args = json.dumps([schedule, model, rules, mesh, _n_devices(mesh), overrides, reference, steps])
    out = subprocess.run([sys.executable, "-c", _DIVERGED_RUN, args], capture_output=True, text=True,
                         timeout=600, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["schedule"] == schedule and r["diverge"] and r["stages"] == int(mesh.split(",")[0][6:])
    if steps >= 10:
        assert r["losses"][-1] < r["losses"][0] - 0.3, "it should learn within 10 steps"
    np.testing.assert_allclose(r["losses"], r["reference"], rtol=1e-5)
    assert r["failing"] == []


@pytest.mark.parametrize(
    "overrides,named",
    [(["pipeline.schedule=zb_h1"], "zb_h1"),
     (["pipeline.backward=scheduled"], "gpipe with pipeline.backward=scheduled")],
    ids=["zb_h1", "gpipe-scheduled"],
)  # fmt: skip
def test_stages_apart_on_cpu_without_gloo_collectives_say_how_to_run_it(devices, overrides, named):
    """XLA:CPU's in-process collectives (this process: no JAX runtime) cannot run stages that reach
    different collectives at once: the first step is refused, naming what works; the step still
    compiles (a dry-run needs nothing)."""
    from spmd.core.errors import UserError

    setup = assemble("tiny", "stage=2,fsdp=2", "pp_fsdp", devices=devices[:4],
                     overrides=[*overrides, "pipeline.microbatches=2"])  # fmt: skip
    trainer = setup.trainer
    state = trainer.init_state()
    with pytest.raises(UserError, match=f"pipeline.schedule={named} runs different collectives .* XLA:CPU's "
                                        "in-process collectives cannot: train with spmd-train"):  # fmt: skip
        trainer.train_step(state, setup.batches().train_batch(0))
    assert hasattr(trainer.train_step, "lower")


def test_gpipe_runs_its_stages_apart_where_they_may_diverge_and_the_loss_is_the_lm_loss(devices, monkeypatch):
    """pipeline.backward = auto: GPipe's fill-and-drain table where the stages' collectives may
    diverge (here made to say so) and the objective is the LM loss; the lockstep loop for a
    preference objective, for `autodiff`, and where the collectives cannot diverge (this process)."""
    from spmd.platform import distributed

    def lockstep(backward, objective="lm"):
        setup = assemble("tiny", "stage=2,data=2", "pp", devices=devices[:4], overrides=[
            f"pipeline.backward={backward}", f"train.objective={objective}"], optimizer=False)  # fmt: skip
        return setup.plan.schedule.lockstep

    assert lockstep("auto") and not lockstep("scheduled")
    monkeypatch.setattr(distributed, "collectives_may_diverge", lambda devices: True)
    assert not lockstep("auto") and lockstep("auto", "dpo") and lockstep("autodiff")
    assert not lockstep("scheduled", "dpo")  # refused by the trainer, naming what works


def test_circular_layer_order_gives_each_stage_its_round_robin_groups():
    # 8 groups, 2 stages, 2 repeats: stage 0 runs groups 0-1 (repeat 0) and 4-5 (repeat 1).
    from spmd.parallel.pipeline import Schedule

    order = layer_order(8, Schedule(stages=2, microbatches=2, repeats=2))
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert layer_order(8, Schedule(stages=2, microbatches=2)) is None  # GPipe: stored in order


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_checkpoint_moves_out_of_and_into_a_pipeline(tmp_path, deep_single):
    """Circular stage=4 -> fsdp=8 (no pipeline) -> interleaved zero-bubble stage=2 with tensor ->
    ZB-H1 stage=4: the moved run continues with the unmoved run's losses (checkpoints hold the
    canonical layer order)."""
    ref_losses = deep_single[0]
    common = ["--config", "tiny", "--host-devices", "8", "--set", "model.n_layers=8", "--set",
              "optimizer.schedule_steps=40", "--set", "checkpoint.every=2", "--log-every", "1"]  # fmt: skip
    legs = [
        (
            "stage=4,data=2",
            "pp",
            [
                "--set",
                "pipeline.schedule=circular",
                "--set",
                "pipeline.repeats=2",
                "--set",
                "pipeline.microbatches=4",
            ],
            2,
        ),  # fmt: skip
        ("fsdp=8", "fsdp", [], 4),
        (
            "stage=2,tensor=2,data=2",
            "pp_fsdp_tp",
            [
                "--set",
                "pipeline.microbatches=2",
                "--set",
                "pipeline.schedule=interleaved_zb",
                "--set",
                "pipeline.repeats=2",
            ],
            6,
        ),  # fmt: skip
        # ZB-H1 on four stages, whose stages diverge (spmd-train starts gloo collectives for it)
        ("stage=4,data=2", "pp", ["--set", "pipeline.microbatches=4", "--set", "pipeline.schedule=zb_h1"], 8),
    ]
    losses, previous = {}, None
    for i, (mesh, rules, extra, steps) in enumerate(legs):
        run_dir = tmp_path / f"leg{i}"
        resume = ["--resume-from", str(previous)] if previous else []
        result = spmd_train(*common, "--mesh", mesh, "--rules", rules, *extra, "--steps", str(steps),
                            "--run-dir", str(run_dir), *resume)  # fmt: skip
        assert result.returncode == 0, result.stderr
        losses.update({r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r})
        previous = run_dir
    assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7, 8]
    np.testing.assert_allclose([losses[s] for s in range(1, 9)], ref_losses[:8], rtol=1e-5)


@pytest.fixture(scope="module")
def pipelined_dry_runs(devices):
    """Dry-runs of `tiny` (8 layers) under GPipe on stage=2,data=4 with M = 4 and 8, and the same
    per-device rows without a pipeline (data=4 on 4 devices)."""
    out = {}
    for m in (4, 8):
        setup = assemble("tiny", "stage=2,data=4", "pp", overrides=[*DEEP, "train.global_batch_size=32",
                         "train.seq_len=32", f"pipeline.microbatches={m}"], devices=devices)  # fmt: skip
        out[m] = (setup, dry_run(setup, explain=True))
    setup = assemble(
        "tiny",
        "data=4",
        "dp",
        overrides=[*DEEP, "train.global_batch_size=32", "train.seq_len=32"],
        devices=devices[:4],
    )
    out["dp"] = (setup, dry_run(setup))
    return out


def test_pipelined_step_sends_activations_between_stages_only_by_collective_permute(pipelined_dry_runs):
    setup, r = pipelined_dry_runs[4]
    pp = r["pipeline"]
    S, M = 2, 4
    assert pp["bubble_fraction"] == (S - 1) / (M + S - 1) and pp["iterations"] == M + S - 1
    over_stage = [c for c in r["collectives"] if "stage" in c["axes"]]
    permutes = [c for c in over_stage if c["kind"] == "collective-permute"]
    assert permutes and all(c["axes"] == ["stage"] for c in permutes)
    # One microbatch's (b, T, D) fp32 activations per iteration, forward and (gradients) backward.
    b = 32 // 4 // M  # rows per microbatch on one device (batch split over data=4 in the pipeline)
    assert pp["collective_permute_bytes"] == 2 * (M + S - 1) * b * 32 * 64 * 4
    # No weights cross stages: every collective over `stage` alone is the pipeline's moving
    # activations (inputs to stage 0, outputs to the stages that run the head, microbatches on).
    stage_rows = [row for row in r["explain"]["rules"] if row["rule"].endswith("-> stage")]
    assert stage_rows and all(row["rule"] == "layers -> stage" for row in stage_rows)
    assert all(row["what"].startswith("pipeline:") for row in stage_rows)
    assert not [u for u in r["explain"]["unexplained"] if "stage" in u["axes"]]
    assert r["analytic_minimum_bytes"]["stage"] == 2 * (32 // 4) * 32 * 64 * 4


def test_idle_stages_show_in_compiled_flops_and_the_bubble_in_the_estimate(pipelined_dry_runs):
    """Per device a stage runs its 4 of 8 layers on every microbatch slot, bubble included, and the
    head (and loss) on its half of the rows (the batch outside the pipeline is split over stage):
    F(M) = 4 w (M + S - 1) / M + H / 2, where the unpipelined device runs 8 w + H."""
    f4 = pipelined_dry_runs[4][1]["compiled_matmul_flops_per_device"]
    f8 = pipelined_dry_runs[8][1]["compiled_matmul_flops_per_device"]
    f_dp = pipelined_dry_runs["dp"][1]["compiled_matmul_flops_per_device"]
    w = (f4 - f8) / (4 * (5 / 4 - 9 / 8))  # one layer's matmuls on the device's rows
    assert w > 0
    head_dp, head_pp = f_dp - 8 * w, f4 - 5 * w
    assert head_dp > 0
    np.testing.assert_allclose(head_pp, head_dp / 2, rtol=1e-6)
    setup, r = pipelined_dry_runs[4]
    model_per_device = r["model_flops_per_device"]
    assert f4 > model_per_device  # the model FLOPs leave the idle stages out
    hw = {"peak": 1e12, "ici": 1e11, "dcn": 1e10}
    est = estimate(setup.cfg, setup.plan, hw, 1)
    assert est["bubble_fraction"] == 0.2
    np.testing.assert_allclose(est["compute_s"], model_per_device / 1e12 / 0.8, rtol=1e-9)


@pytest.fixture(scope="module")
def scheduled_dry_runs(devices):
    """Dry-runs of `tiny` (8 layers, remat full) on stage=4,data=2 under GPipe (lockstep here: XLA:CPU
    in one process), GPipe with its backward scheduled ("gpipe_scheduled"), 1F1B, ZB-H1 and
    interleaved zero-bubble (2 repeats) with M = 8 and 16 microbatches of 8 sequences each, and
    on data=2 without a pipeline ("none") at the same batch."""
    out = {}
    for name in ("gpipe", "gpipe_scheduled", "1f1b", "zb_h1", "interleaved_zb"):
        more = {"interleaved_zb": ["pipeline.repeats=2"],
                "gpipe_scheduled": ["pipeline.backward=scheduled"]}.get(name, [])  # fmt: skip
        for m in (8, 16):
            setup = assemble("tiny", "stage=4,data=2", "pp", devices=devices, overrides=[
                *DEEP, "model.remat=full", "train.seq_len=32", f"train.global_batch_size={8 * m}",
                f"pipeline.schedule={name.removesuffix('_scheduled')}", f"pipeline.microbatches={m}",
                *more])  # fmt: skip
            out[name, m] = dry_run(setup)
    for m in (8, 16):  # without a pipeline, on the data axis alone
        setup = assemble("tiny", "data=2", "fsdp", devices=devices[:2], overrides=[
            *DEEP, "model.remat=full", "train.seq_len=32", f"train.global_batch_size={8 * m}"])  # fmt: skip
        out["none", m] = dry_run(setup)
    return out


def test_1f1b_holds_a_fixed_number_of_microbatches_and_counts_the_bubble_gpipe_has(scheduled_dry_runs):
    S = 4
    for m in (8, 16):
        gpipe, one = scheduled_dry_runs["gpipe", m]["pipeline"], scheduled_dry_runs["1f1b", m]["pipeline"]
        analytic = (S - 1) / (m + S - 1)
        assert gpipe["bubble_fraction"] == one["bubble_fraction"] == analytic
        # Each pass's ticks, from the compiled step's moves between stages: GPipe's passes M + S - 1
        # ticks each; 1F1B's stages one pass (F or a whole backward) in each of 2 (M + S - 1)
        # ticks (the tick loop's trips).
        assert gpipe["ticks_counted"] == {"forward": m + S - 1, "backward": m + S - 1}
        assert one["ticks_counted"] == {"forward": 2 * (m + S - 1), "backward": 2 * (m + S - 1)}
        assert one["bubble_counted"] == pytest.approx(analytic)
        assert gpipe["in_flight"] == m + S - 1 and one["in_flight"] == S
    temp = {k: r["per_device_bytes"]["temporaries"] for k, r in scheduled_dry_runs.items()}
    # Twice the microbatches: GPipe keeps 8 more microbatches' saved activations per stage (two
    # layer inputs each under remat full); 1F1B's memory stays within one microbatch's activations
    # (it embeds each microbatch as it enters and holds S at most).
    one_microbatch = 8 // 2 * 32 * 64 * 4  # rows per device x T x D x fp32
    assert temp["gpipe", 16] - temp["gpipe", 8] > 8 * 2 * one_microbatch
    assert abs(temp["1f1b", 16] - temp["1f1b", 8]) < one_microbatch
    assert abs(temp["zb_h1", 16] - temp["zb_h1", 8]) < one_microbatch
    assert abs(temp["interleaved_zb", 16] - temp["interleaved_zb", 8]) < one_microbatch


def test_scheduled_pipelines_move_only_what_a_stage_sent(scheduled_dry_runs):
    """Each tick each way, only the stages whose pass made something for a neighbour send it (one
    conditional over the table's sets of stage pairs, the same on every stage): the compiled
    step's permutes carry one microbatch's activations per tick in which some stage sends, counted
    at each set's share of the ticks, not two every tick; the ticks stay the loop's."""
    from spmd.parallel.scheduled import Ticks

    S = 4
    one_microbatch = 8 // 2 * 32 * 64 * 4  # rows per device x T x D x fp32
    for name, ticks_of in (("1f1b", lambda m: Ticks(S, m)), ("zb_h1", lambda m: Ticks(S, m, split=True)),
                           ("interleaved_zb", lambda m: Ticks(S, m, 2, True))):  # fmt: skip
        for m in (8, 16):
            ticks, pp = ticks_of(m), scheduled_dry_runs[name, m]["pipeline"]
            busy, both = 0, collections.Counter()
            for forward in (True, False):
                sets, index = ticks.moves(forward)
                assert len(index) == ticks.total and len(set(sets)) == len(sets)
                busy += sum(bool(sets[i]) for i in index)
                # every stage's sends, each way: one per microbatch chunk that leaves it
                sent = collections.Counter(a for i in index for a, _ in sets[i])
                last = S - 1 if forward else 0
                assert all(sent[s] == ticks.repeats * m - (s == last) * m for s in range(S))
                both += sent
            assert busy < 2 * ticks.total
            assert pp["collective_permute_bytes"] == busy * one_microbatch
            # the busiest stage's devices: its own sends only (2 R M chunks in the middle of the pipe)
            assert pp["collective_permute_bytes_busiest"] == max(both.values()) * one_microbatch
            assert max(both.values()) == 2 * ticks.repeats * m
            lockstep = scheduled_dry_runs["gpipe", m]["pipeline"]  # every stage sends every tick
            assert lockstep["collective_permute_bytes_busiest"] == lockstep["collective_permute_bytes"] > 0
            assert pp["ticks_counted"] == {"forward": ticks.total, "backward": ticks.total}


def test_zb_h1_idles_a_third_of_what_1f1b_idles_and_neither_computes_an_idle_slot(scheduled_dry_runs):
    """ZB-H1 with stages that diverge: 3 M + S - 1 ticks
    (counted in the compiled step), each stage running one pass in each, so each idles S - 1 pass
    slots against 1F1B's 3 (S - 1): the published third. Their idle slots run the empty branch, so
    both compile the unpipelined step's FLOPs (the tick's passes counted at the share of the
    table's ticks that run them), within 1 + the bubble; GPipe's lockstep idle slots compute."""
    S = 4
    idle = lambda b: b / (1 - b)  # noqa: E731 (idle slots over useful ones)
    for m in (8, 16):
        zb, one, flat = (
            scheduled_dry_runs["zb_h1", m],
            scheduled_dry_runs["1f1b", m],
            scheduled_dry_runs["none", m],
        )
        pp = zb["pipeline"]
        analytic = (S - 1) / (3 * m + S - 1)
        assert pp["ticks_counted"] == {"forward": 3 * m + S - 1, "backward": 3 * m + S - 1}
        assert pp["bubble_fraction"] == analytic and pp["bubble_counted"] == pytest.approx(analytic)
        assert idle(pp["bubble_counted"]) == pytest.approx(idle(one["pipeline"]["bubble_counted"]) / 3)
        # Per device: the pipelined mesh has 8 devices, the unpipelined 2 (the same data axis).
        unpiped = flat["compiled_matmul_flops_per_device"] / 4
        for run in (zb, one):
            flops = run["compiled_matmul_flops_per_device"]
            assert flops <= unpiped * (1 + run["pipeline"]["bubble_counted"])
            assert flops == pytest.approx(unpiped, rel=1e-3)
        gpipe = scheduled_dry_runs["gpipe", m]
        assert gpipe["compiled_matmul_flops_per_device"] > unpiped * (1 + gpipe["pipeline"]["bubble_counted"])
        # Held per stage: at most S + 1 microbatches' residuals (and S of W's operand sets).
        assert pp["in_flight"] <= S + 1
        # Nothing over stage but the moves and the embedding's and head's gradients (summed once),
        # the same for both.
        assert 0 < pp["other_stage_bytes"] == one["pipeline"]["other_stage_bytes"]


def test_gpipe_scheduled_computes_no_idle_slot_and_holds_every_microbatch(scheduled_dry_runs):
    """GPipe with its backward scheduled (the fill-and-drain table): 1F1B's ticks and bubble, the
    unpipelined step's FLOPs where the lockstep loop computes its idle slots (1 / (1 - bubble)),
    and GPipe's memory: every microbatch's residuals held at the end of the forwards."""
    S = 4
    one_microbatch = 8 // 2 * 32 * 64 * 4  # rows per device x T x D x fp32
    temp = {k: r["per_device_bytes"]["temporaries"] for k, r in scheduled_dry_runs.items()}
    for m in (8, 16):
        run, lockstep = scheduled_dry_runs["gpipe_scheduled", m], scheduled_dry_runs["gpipe", m]
        pp, analytic = run["pipeline"], (S - 1) / (m + S - 1)
        assert pp["backward"] == "scheduled" and lockstep["pipeline"]["backward"] == "lockstep"
        assert pp["ticks_counted"] == {"forward": 2 * (m + S - 1), "backward": 2 * (m + S - 1)}
        assert pp["bubble_fraction"] == analytic and pp["bubble_counted"] == pytest.approx(analytic)
        assert pp["in_flight"] == m
        unpiped = scheduled_dry_runs["none", m]["compiled_matmul_flops_per_device"] / 4
        assert run["compiled_matmul_flops_per_device"] == pytest.approx(unpiped, rel=1e-3)
        assert run["compiled_matmul_flops_per_device"] <= unpiped * (1 + pp["bubble_counted"])
        assert lockstep["compiled_matmul_flops_per_device"] == pytest.approx(
            unpiped / (1 - analytic), rel=0.05
        )
    assert temp["gpipe_scheduled", 16] - temp["gpipe_scheduled", 8] > 8 * one_microbatch


def test_interleaved_zb_idles_a_sixth_of_what_1f1b_idles_and_computes_no_idle_slot(scheduled_dry_runs):
    """Two chunks per stage, one chunk's pass (F, B or W) per stage and tick: 3 R M + S - 1 ticks
    (counted in the compiled step), S - 1 of them idle, each a chunk's pass: idle time a third of
    1F1B's over R (its whole backward two passes), and the unpipelined step's FLOPs. W's operands
    wait chunk-sized, so it holds less than ZB-H1."""
    S, R = 4, 2
    temp = {k: r["per_device_bytes"]["temporaries"] for k, r in scheduled_dry_runs.items()}
    idle = lambda b: b / (1 - b)  # noqa: E731 (idle slots over useful ones)
    for m in (8, 16):
        zb, one = scheduled_dry_runs["interleaved_zb", m], scheduled_dry_runs["1f1b", m]
        pp = zb["pipeline"]
        analytic = (S - 1) / (3 * R * m + S - 1)
        assert pp["ticks_counted"] == {"forward": 3 * R * m + S - 1, "backward": 3 * R * m + S - 1}
        assert pp["bubble_fraction"] == analytic and pp["bubble_counted"] == pytest.approx(analytic)
        assert pp["in_flight"] <= 2 * R * S - 1
        assert idle(pp["bubble_counted"]) == pytest.approx(idle(one["pipeline"]["bubble_counted"]) / (3 * R))
        unpiped = scheduled_dry_runs["none", m]["compiled_matmul_flops_per_device"] / 4
        assert zb["compiled_matmul_flops_per_device"] == pytest.approx(unpiped, rel=1e-3)
        assert temp["interleaved_zb", m] < temp["zb_h1", m]


def test_interleaved_1f1b_computes_the_unpipelined_work_where_circular_computes_its_bubble(devices):
    """Interleaved 1F1B's idle ticks run the empty branch: the unpipelined step's FLOPs (the
    branches counted at their shares of the table's ticks), within 1 + its bubble; so does
    circular with its backward scheduled (its fill-and-drain table over the same chunks), where
    its lockstep program computes its idle slots."""
    flops, pp = {}, {}
    common = [*DEEP, "train.seq_len=32", "train.global_batch_size=32"]
    for name, backward in (("circular", "autodiff"), ("circular", "scheduled"), ("interleaved_1f1b", "auto")):
        setup = assemble("tiny", "stage=4,data=2", "pp", devices=devices, overrides=[
            *common, f"pipeline.schedule={name}", "pipeline.repeats=2", "pipeline.microbatches=4",
            f"pipeline.backward={backward}"])  # fmt: skip
        r = dry_run(setup)
        flops[backward], pp[backward] = r["compiled_matmul_flops_per_device"], r["pipeline"]
    assert all(pp[k]["bubble_counted"] == pytest.approx(3 / 11) for k in pp)
    assert pp["scheduled"]["backward"] == "scheduled" and pp["autodiff"]["backward"] == "lockstep"
    unpiped = dry_run(assemble("tiny", "data=8", "fsdp", devices=devices, overrides=common))
    unpiped = unpiped["compiled_matmul_flops_per_device"]
    assert flops["auto"] == pytest.approx(unpiped, rel=1e-3)
    assert flops["scheduled"] == pytest.approx(unpiped, rel=1e-3)
    assert flops["autodiff"] > unpiped * (1 + 3 / 11)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["pipeline.schedule=zb_h1", "pipeline.repeats=2"],
            "needs pipeline.schedule = circular, interleaved_1f1b or interleaved_zb",
        ),
        (["pipeline.schedule=interleaved_1f1b"], "needs pipeline.repeats >= 2 .* it is 1f1b"),
        (["pipeline.schedule=interleaved_zb"], "needs pipeline.repeats >= 2 .* it is zb_h1"),
        (
            ["pipeline.schedule=1f1b", "pipeline.repeats=2"],
            "needs pipeline.schedule = circular, interleaved_1f1b or interleaved_zb",
        ),
        (
            [*INTERLEAVED_ZB, "pipeline.microbatches=6"],
            "interleaved_zb runs microbatches in groups of the 4 stages",
        ),  # fmt: skip
        (
            ["pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", "pipeline.microbatches=6"],
            "must be a multiple of 4",
        ),  # fmt: skip
        (["pipeline.schedule=1f1b", "pipeline.microbatches=2"], "must be at least the number of stages"),
        (["pipeline.schedule=1f1b", "train.objective=dpo"], "needs pipeline.schedule = gpipe or circular"),
        (
            ["pipeline.backward=scheduled", "train.objective=dpo"],
            "gpipe with pipeline.backward=scheduled runs the language-model loss inside .* = auto or autodiff",
        ),
        (
            ["pipeline.schedule=zb_h1", "pipeline.backward=autodiff"],
            "pipeline.backward = autodiff needs pipeline.schedule = gpipe or circular",
        ),
        (["pipeline.backward=later"], "pipeline.backward must be one of auto, scheduled, autodiff"),
    ],
)
def test_schedules_that_cannot_apply_say_what_works(devices, overrides, message):
    from spmd.core.errors import UserError

    with pytest.raises(UserError, match=message):
        assemble("tiny", "stage=4,data=2", "pp", overrides=[*DEEP, "train.global_batch_size=48", *overrides],
                 devices=devices)  # fmt: skip


def test_gather_once_gathers_fsdp_weights_once_per_step_not_per_iteration(devices):
    def fsdp_gathers(gather_once):
        setup = assemble("tiny", "stage=2,fsdp=4", "pp_fsdp", devices=devices, overrides=[
            *DEEP, "train.global_batch_size=16", "pipeline.microbatches=4", f"pipeline.gather_once={gather_once}"])  # fmt: skip
        r = dry_run(setup)
        rows = [c for c in r["collectives"] if c["kind"] == "all-gather" and c["axes"] == ["fsdp"]]
        return (
            sum(c["count"] for c in rows),
            sum(c["volume_bytes"] for c in rows),
            r["per_device_bytes"]["peak"],
        )

    (n_each, sent_each, peak_each), (n_once, sent_once, peak_once) = fsdp_gathers(False), fsdp_gathers(True)
    # Per iteration: each of the stage's weights gathered in every one of the M + S - 1 = 5 iterations,
    # forward and backward; once: outside the schedule.
    assert n_once * 10 < n_each and sent_once * 4 < sent_each
    assert peak_once > peak_each  # the stage's weights (and gradient sums) held whole meanwhile


def test_planner_searches_stage_and_decoding_runs_without_a_pipeline(devices):
    from spmd.assembly.planner import enumerate_candidates

    cfg = load_config("tiny", DEEP)
    found = {
        (m, p) for m, p, setup, _ in enumerate_candidates(cfg, 4, ("stage", "data"), devices[:4]) if setup
    }
    assert {("stage=2,data=2", "pp"), ("stage=4", "pp"), ("data=4", "dp")} <= found
    decoding = load_rules("pp").for_decoding()
    assert decoding.mapping["layers"] == () and decoding.mapping["batch"][0] == "stage"


def test_pipeline_compiles_for_tpu_with_stages_across_slices():
    """The TPU compiler: GPipe's lockstep loop sends one collective-permute per iteration each
    way over `stage` (its bytes parsed from collective-permute-start); on TPU `auto` schedules
    GPipe's backward, whose moves run only in the ticks a stage sends (stage 0's two forwards,
    stage 1's two backwards); `--dcn-mesh stage=2` over two slices puts each stage on one slice."""
    from spmd.analysis import topology

    b = 8 // 2 // 2  # rows per microbatch on one device (batch 8 over fsdp=2, M = 2)
    for backward, moves in (("autodiff", 2 * 3), ("auto", 2 + 2)):
        setup = assemble("tiny", "stage=2,fsdp=2", "pp_fsdp", devices=topology.devices("v5e:2x2"), overrides=[
            *DEEP, "pipeline.microbatches=2", f"pipeline.backward={backward}"])  # fmt: skip
        assert setup.plan.schedule.lockstep == (backward == "autodiff")
        r = dry_run(setup)
        assert r["platform"] == "tpu"
        assert r["pipeline"]["collective_permute_bytes"] == moves * b * 64 * 64 * 4
        assert r["compiled_matmul_flops_per_device"] is None  # convolutions: not modelled
    devices = topology.devices("v5e:2x2", num_slices=2)
    s = assemble("tiny", "fsdp=4", "pp_fsdp", overrides=[*DEEP, "pipeline.microbatches=2"], devices=devices,
                 dcn_mesh="stage=2")  # fmt: skip
    by_stage = [s.mesh.devices.take(i, axis=0) for i in range(2)]
    assert [{d.slice_index for d in part.flat} for part in by_stage] in ([{0}, {1}], [{1}, {0}])
    assert s.plan.schedule.stages == 2


def test_residuals_computed_from_the_weights_alone_are_recomputed_not_held():
    """A layer scan saves each layer's (transposed) weight for its backward; 1F1B holds only the
    residuals that depend on the microbatch in its slots and recomputes the rest from the weights."""
    import jax.numpy as jnp

    from spmd.parallel.scheduled import weight_only

    def stage(x, w, side):
        def layer(c, w_l):
            return jnp.tanh(c @ w_l.T), None

        out, pullback = jax.vjp(lambda x, w: jax.lax.scan(layer, x, w)[0], x, w)
        return out, None, jax.tree.leaves(pullback)

    x, w = jnp.ones((3, 4)), jnp.arange(32.0).reshape(2, 4, 4) / 32
    recompute, depends = weight_only(stage, x, w, ())
    leaves = stage(x, w, ())[2]
    assert [leaf.shape for leaf in leaves] == [(2, 4, 4), (2, 3, 4), (2, 3, 4)] and depends == [
        False,
        True,
        True,
    ]
    np.testing.assert_array_equal(recompute(w)[0], leaves[0])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_scheduled_pipeline_resumes_after_sigkill_exactly(tmp_path, schedule):
    """Killed after its step-3 checkpoint and resumed: the same losses, bit for bit, as a run that
    was not interrupted (1F1B and ZB-H1, their stages diverging)."""
    from test_preemption import losses, start, wait_for

    from spmd.io import checkpoint as ckpt

    args = ["--mesh", "stage=2", "--rules", "pp", "--host-devices", "2", "--set", f"pipeline.schedule={schedule}",
            "--set", "pipeline.microbatches=2", "--steps", "6", "--checkpoint-every", "3"]  # fmt: skip
    common = ["--config", "tiny", "--log-every", "1", "--eval-every", "0"]
    reference = tmp_path / "reference"
    assert spmd_train(*common, *args, "--run-dir", str(reference)).returncode == 0
    run_dir = tmp_path / "run"
    proc = start(run_dir, *args)
    wait_for(lambda: 3 in ckpt.committed_steps(run_dir / ckpt.SUBDIR), proc)
    proc.kill()
    proc.wait()
    result = spmd_train(*common, *args, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr
    assert losses(run_dir) == losses(reference)


def test_lora_resumes_onto_its_frozen_base_in_a_permuted_layer_order(tmp_path):
    """LoRA from another run's weights under interleaved zero-bubble (layers stored permuted) trains
    like LoRA on one device; a run resumed from its step-2 checkpoint, which holds only the
    adapters, rebuilds the frozen base from those canonical weights in the stored order and
    continues with the uninterrupted run's losses."""
    from test_preemption import losses

    base = tmp_path / "base"
    common = ["--config", "tiny", "--set", "model.n_layers=4", "--log-every", "1", "--eval-every", "0"]
    assert spmd_train(*common, "--steps", "1", "--run-dir", str(base)).returncode == 0
    lora = ["--init-from", str(base), "--set", "lora.rank=4", "--set", "lora.alpha=8", "--set",
            "optimizer.learning_rate=1e-2", "--checkpoint-every", "2"]  # fmt: skip
    args = [*lora, "--mesh", "stage=2", "--rules", "pp", "--host-devices", "2", "--set",
            "pipeline.schedule=interleaved_zb", "--set", "pipeline.repeats=2", "--set", "pipeline.microbatches=2"]  # fmt: skip
    one, reference, run_dir = tmp_path / "one", tmp_path / "reference", tmp_path / "run"
    assert spmd_train(*common, *lora, "--steps", "4", "--run-dir", str(one)).returncode == 0
    assert spmd_train(*common, *args, "--steps", "4", "--run-dir", str(reference)).returncode == 0
    np.testing.assert_allclose([x for _, x in losses(reference)], [x for _, x in losses(one)], rtol=1e-5)
    assert spmd_train(*common, *args, "--steps", "2", "--run-dir", str(run_dir)).returncode == 0
    result = spmd_train(*common, *args, "--steps", "4", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stderr
    assert losses(run_dir) == losses(reference)
