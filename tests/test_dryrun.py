"""spmd-dryrun: exact per-device bytes, collectives that scale with depth, errors."""

import json

import pytest
from test_cli import ROOT  # noqa: F401  (path setup shared with the CLI tests)
from test_inference import run_script

from spmd.analysis import aot
from spmd.assembly.setup import assemble

V, D, L, N, K, H, F = 256, 64, 2, 4, 2, 16, 192
MATRICES = 4 * (V * D + D * V + L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F))
NORMS = 4 * (2 * L + 1) * D


def report(mesh, rules, *sets):
    return aot.dry_run(assemble("tiny", mesh, rules, overrides=sets))


@pytest.mark.parametrize(
    "mesh,rules,params",
    [
        ("data=8", "dp", MATRICES + NORMS),
        ("fsdp=8", "fsdp", MATRICES // 8 + NORMS),
        ("data=4,tensor=2", "tp", MATRICES // 2 + NORMS),
    ],
)
def test_param_and_optimizer_bytes_are_exact(devices, mesh, rules, params):
    r = report(mesh, rules)
    got = r["per_device_bytes"]
    assert got["params"] == params and got["gradients"] == params
    assert (
        got["optimizer_state"] == 2 * params + 8
    )  # Adam mu and nu, plus two int32 step counts (Adam, schedule)
    assert got["arguments"] >= params + 2 * params  # the compiled step really takes them as inputs
    # The peak holds the temporaries (XLA:CPU's own peak figure does not) and the donated state once.
    assert got["peak"] == got["arguments"] + got["outputs"] - got["aliased"] + got["temporaries"]
    assert got["aliased"] >= params + 2 * params and got["peak"] > got["temporaries"]


def test_sharded_weight_update_splits_the_optimizer_state_over_data():
    """dp_zero1 on data=8: parameters stay replicated, the optimizer state is 1/8 per device, and
    the updated parameters are all-gathered over data (XLA:CPU reduces the gradients with an
    all-reduce, then each device slices its part: it has no reduce-scatter creator)."""
    dp, zero = report("data=8", "dp"), report("data=8", "dp_zero1")
    params = MATRICES + NORMS
    assert zero["per_device_bytes"]["params"] == dp["per_device_bytes"]["params"] == params
    assert dp["per_device_bytes"]["optimizer_state"] == 2 * params + 8
    assert zero["per_device_bytes"]["optimizer_state"] <= 1.05 * (2 * params + 8) / 8
    gathered = sum(c["result_bytes"] for c in zero["collectives"] if c["kind"] == "all-gather")
    assert gathered >= MATRICES and not any(c["kind"] == "all-gather" for c in dp["collectives"])


def _counts(r):
    return {(c["kind"], tuple(c["axes"])): c["count"] for c in r["collectives"]}


def test_collectives_have_the_expected_kinds_and_scale_with_depth(devices):
    fsdp2, fsdp4 = _counts(report("fsdp=8", "fsdp")), _counts(report("fsdp=8", "fsdp", "model.n_layers=4"))
    assert fsdp2[("all-gather", ("fsdp",))] > 0
    assert fsdp4[("all-gather", ("fsdp",))] > fsdp2[("all-gather", ("fsdp",))]
    tp2, tp4 = (
        _counts(report("data=4,tensor=2", "tp")),
        _counts(report("data=4,tensor=2", "tp", "model.n_layers=4")),
    )
    assert tp2[("all-reduce", ("tensor",))] > 0 and ("all-reduce", ("data",)) in tp2
    assert tp4[("all-reduce", ("tensor",))] > tp2[("all-reduce", ("tensor",))]
    dp = report("data=8", "dp")
    assert set(_counts(dp)) == {("all-reduce", ("data",))}
    # Gradients plus a few scalars (loss and token sums), nothing else.
    assert dp["collective_volume_bytes"] == pytest.approx(dp["analytic_minimum_total"], rel=1e-4)


def _volume(r, kind, axes):
    return sum(c["volume_bytes"] for c in r["collectives"] if c["kind"] == kind and tuple(c["axes"]) == axes)


def test_context_parallel_traffic_matches_the_analytic_minimum(devices):
    """The model of what ring and all-gather attention send (spmd.analysis.aot.analytic_minimum) against the
    compiled step; both also all-reduce the gradients over `context`, whose devices see different tokens."""
    ring = report("context=8", "cp_ring")
    assert _volume(ring, "collective-permute", ("context",)) == ring["analytic_minimum_bytes"]["context"] > 0
    gather = report("context=8", "allgather")
    # The load-balance permutation all-gathers the int32 token ids (2 x B x T x 4 bytes x 7/8): not in the model.
    tokens = 2 * 8 * 64 * 4 * 7 / 8
    sent = (
        _volume(gather, "all-gather", ("context",)) - tokens + _volume(gather, "reduce-scatter", ("context",))
    )
    assert sent == gather["analytic_minimum_bytes"]["context"] > 0
    for r in (ring, gather):
        assert _volume(r, "all-reduce", ("context",)) == pytest.approx(
            r["analytic_minimum_bytes"]["data"], rel=1e-4
        )


def test_cli_json_and_errors(tmp_path):
    r = run_script("dryrun", "--config", "tiny", "--host-devices", "8", "--mesh", "fsdp=8", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["devices"] == 8
    bad = run_script("dryrun", "--config", "tiny", "--host-devices", "8", "--mesh", "fsdp=3")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "8 are available" in bad.stderr
    bad = run_script("dryrun", "--config", "tiny", "--host-devices", "8", "--rules", "zero3")
    assert bad.returncode == 2 and "unknown rules preset 'zero3'" in bad.stderr


def test_explain_attributes_tensor_parallel_traffic_to_its_rules(tmp_path):
    """--explain on tp: every collective over `tensor` is put down to a rule of the tp preset
    (heads/mlp partial sums, the split vocabulary, the regrouped attention heads); a deliberately
    bad rules file splitting `embed` over tensor shows its traffic under "embed -> tensor"."""
    from spmd.core.rules import load_rules

    tp = aot.dry_run(assemble("tiny", "data=4,tensor=2", "tp"), explain=True)["explain"]
    on_tensor = [r for r in tp["rules"] if "tensor" in r["rule"].split(" -> ")[1]]
    assert not [u for u in tp["unexplained"] if "tensor" in u["axes"]]
    tp_names = {n for n, axes in load_rules("tp").mapping.items() if "tensor" in axes}
    for row in on_tensor:
        assert set(row["rule"].split(" -> ")[0].split("/")) <= tp_names, row
    partial = [
        r for r in on_tensor if r["kind"] == "all-reduce" and r["what"].startswith("partial sums of a layer")
    ]
    assert partial and {"heads", "mlp"} <= set(partial[0]["rule"].split(" -> ")[0].split("/"))
    assert not [r for r in tp["rules"] if r["rule"].startswith("embed")]

    bad = tmp_path / "embed_tensor.toml"
    bad.write_text('extends = "dp"\ndescription = "bad: embed over tensor"\n\n[rules]\nembed = "tensor"\n')
    worse = aot.dry_run(assemble("tiny", "data=4,tensor=2", str(bad)), explain=True)
    blamed = sum(r["volume_bytes"] for r in worse["explain"]["rules"] if r["rule"] == "embed -> tensor")
    assert blamed > 0.5 * worse["collective_volume_bytes"]  # most of what it sends is that rule's
    assert {r["what"] for r in worse["explain"]["rules"] if r["rule"] == "embed -> tensor"} >= {
        "weights gathered",
        "partial sums of a layer's matmuls over a split dimension",
    }


def test_explain_finds_a_weight_gathered_in_a_transposed_layout():
    """The TPU compiler gathers some weights with their dims permuted (llama-70b fsdp=256: wk and
    wv as (K, H, D)): --explain calls those weights gathered, by all-gather or (forward, or its
    recomputation) as an all-reduce of zero-padded shards; the same shape summed in the backward
    is not a gather."""
    from spmd.analysis import explain
    from spmd.analysis.hlo import Collective

    setup = assemble("tiny", "fsdp=8", "fsdp")
    (wk,) = [p for p in setup.plan.params if p.path.endswith("wk_DKH")]
    D, K, H = wk.shape[1:]
    body = "jit(train_step)/jvp()/while/body/eval_jaxpr/dot_general"

    def why(kind, op_name, as_gather=False):
        c = Collective(kind, ("fsdp",), 4 * D * K * H, 2, "c", 2, "x", ((K, H, D),), op_name, as_gather)
        return explain.attribute(c, setup.plan, setup.cfg)

    assert why("all-gather", body) == ("embed -> fsdp", "weights gathered (in a transposed layout)")
    assert why("all-reduce", body, as_gather=True) == ("embed -> fsdp", explain.AS_ALL_REDUCE_GATHER)
    remat = (
        "jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/checkpoint/rematted_computation/dot_general"
    )
    assert why("all-reduce", remat) == ("embed -> fsdp", explain.AS_ALL_REDUCE_GATHER)
    backward = why("all-reduce", "jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/dot_general")
    assert backward is None or "gathered" not in backward[1]


def test_a_replicating_reshard_becomes_a_report_line_naming_the_rules():
    """XLA's partitioner logs where it reshards a tensor only by replicating it; the dry-run
    (and spmd-plan, which runs it) turns the log line into a note naming the tensor, the two
    shardings and the rules that map onto the mesh axes involved."""
    from spmd.analysis.aot import partitioner_replications
    from spmd.core.rules import load_rules

    line = (
        "W1204 14:49:56.109853 368 spmd_partitioner.cc:666] [SPMD] Involuntary full rematerialization. The "
        "compiler cannot go from sharding {mesh['stage'=1,'data'=1,'fsdp'=2,'context'=1,'expert'=1,'tensor'=2], "
        "[{'fsdp'}, {}, {}]} to {devices=[1,1,2,2]<=[4] last_tile_dim_replicate} efficiently for HLO operation "
        "%fake_parameter.2 = f32[4,64,64]{2,1,0} parameter(2), sharding={...}. As the last resort, SPMD will "
        "replicate the tensor and then partition it\n"
    )
    sizes = {"stage": 1, "data": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
    (note,) = partitioner_replications(line, load_rules("fsdp_tp"), sizes)
    assert note.startswith("the partitioner replicates a f32[4,64,64] tensor to move it from {mesh[")
    assert "embed -> fsdp" in note and "batch -> data/fsdp" in note and "heads -> tensor" not in note
    assert partitioner_replications("", load_rules("fsdp_tp"), sizes) == []


def test_the_strategies_each_own_a_share_and_a_new_one_is_a_module(devices, tmp_path, monkeypatch):
    """The analytic minimum is the sum of every strategy's share (one module of spmd.parallel each)
    and --explain tries their attributions in priority order: a new strategy is one module there,
    found without an edit to the dry-run or the explanation."""
    import spmd.parallel
    from spmd.parallel import strategy

    names = [s.name for s in strategy.strategies()]
    assert names == ["fsdp", "data", "tensor", "expert", "context", "stage", "sync"]
    priorities = [a.priority for s in strategy.strategies() for a in s.attributions]
    assert len(priorities) == len(set(priorities))
    r = report("data=4,tensor=2", "tp")
    assert list(r["analytic_minimum_bytes"]) == names and r["analytic_minimum_bytes"]["tensor"] > 0

    (tmp_path / "spmd_test_strategy.py").write_text(
        "from spmd.parallel.strategy import Attribution, Strategy\n"
        "STRATEGY = Strategy(name='made_up', rank=99, minimum=lambda step: 1000.0 * step.B,\n"
        "    attributions=(Attribution(1, 'collective', lambda c, seen: ('made_up -> ' + ','.join(seen.axes), 'all of it')),))\n"
    )
    monkeypatch.setattr(spmd.parallel, "__path__", [*spmd.parallel.__path__, str(tmp_path)])
    strategy.strategies.cache_clear()
    try:
        r = aot.dry_run(assemble("tiny", "data=4,tensor=2", "tp"), explain=True)
    finally:
        strategy.strategies.cache_clear()
    assert r["analytic_minimum_bytes"]["made_up"] == 1000.0 * 2  # 8 sequences over data=4
    # tried among the "collective" scope (after the weights and gradients), first by its priority
    assert "all of it" in {row["what"] for row in r["explain"]["rules"]} and not r["explain"]["unexplained"]
    assert "partial sums of a layer's matmuls over a split dimension" not in {
        row["what"] for row in r["explain"]["rules"]
    }


def test_the_embedding_lookup_moves_rows_not_the_table():
    """Under FSDP the table stays split along embed: no collective carries the (V, D) table (its
    gather, or its gradient reduced); the looked-up rows go to the residual stream's layout by an
    all-to-all, and their gradient comes back by another."""
    from spmd.analysis import hlo

    setup = assemble("tiny", "fsdp=8", "fsdp")
    t = setup.trainer
    B, T = setup.cfg.train.sequences, setup.cfg.train.seq_len
    text = t.train_step.lower(t.abstract_state, t.abstract_batch(B, T)).compile().as_text()
    items = hlo.collectives(text, setup.mesh)
    # (XLA:CPU reduces the head's gradient as (V, D), from its matmul: not the table's)
    assert not [c for c in items if (V, D) in c.shapes and not c.op_name.endswith("dot_general)")]
    rows = [c for c in items if c.kind == "all-to-all"]
    assert len(rows) == 2 and all(c.axes == ("fsdp",) for c in rows)
    assert [c for c in items if (D, V) in c.shapes and c.kind == "all-gather"]  # the head: a weight
