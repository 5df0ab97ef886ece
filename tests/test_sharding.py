"""Resolved shardings per preset against checked-in golden files; FSDP per-device bytes."""

import os
import pathlib

import jax
import pytest

from spmd import sharding as sharding_lib
from spmd.mesh import build_mesh
from spmd.rules import load_rules

GOLDEN = pathlib.Path(__file__).parent / "golden"
LAYOUTS = {"dp": "data=8", "fsdp": "fsdp=8", "tp": "data=4,tensor=2", "fsdp_tp": "data=2,fsdp=2,tensor=2"}


def resolved(cfg, rules_name):
    mesh = build_mesh(LAYOUTS[rules_name])
    return sharding_lib.plan(
        cfg.model, mesh, load_rules(rules_name), cfg.train.global_batch_size, cfg.train.seq_len
    )


def golden_text(plan) -> str:
    lines = [
        f"# tiny on {LAYOUTS[plan.rules.name]} under {plan.rules.name}: path | logical | spec | per-device shape"
    ]
    for p in plan.params:
        lines.append(f"{p.path} | {p.logical} | {sharding_lib.format_spec(p.spec)} | {p.local_shape}")
    lines.append(f"batch | ('batch', 'seq') | {sharding_lib.format_spec(plan.batch_sharding.spec)}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("rules_name", sorted(LAYOUTS))
def test_golden_shardings(tiny_cfg, devices, rules_name):
    text = golden_text(resolved(tiny_cfg, rules_name))
    path = GOLDEN / f"sharding_{rules_name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), (
        f"sharding of tiny under {rules_name} changed; rerun with UPDATE_GOLDEN=1 if intended"
    )


def test_fsdp_bytes_per_device(tiny_cfg, devices):
    plan = resolved(tiny_cfg, "fsdp")
    assert plan.param_bytes_per_device <= 1.05 * plan.param_bytes_total / 8
    # The per-device bytes are what the arrays really hold.
    from spmd.train import build_trainer

    state = build_trainer(tiny_cfg, plan).init_state()
    on_device0 = sum(
        s.data.nbytes
        for x in jax.tree.leaves(state["params"])
        for s in x.addressable_shards
        if s.device == jax.devices()[0]
    )
    assert on_device0 == plan.param_bytes_per_device


def test_dp_is_fully_replicated_without_warning(tiny_cfg, devices):
    plan = resolved(tiny_cfg, "dp")
    assert plan.replicated_fraction() == 1.0
    assert plan.replication_warning() is None  # replication is what dp means


def test_warns_when_rules_leave_params_replicated(tiny_cfg, devices, tmp_path):
    text = (
        (sharding_lib.rules_lib.PRESET_DIR / "fsdp.toml").read_text().replace('embed = "fsdp"', "embed = []")
    )
    (tmp_path / "oops.toml").write_text(text)
    plan = sharding_lib.plan(
        tiny_cfg.model, build_mesh("fsdp=8"), load_rules(str(tmp_path / "oops.toml")), 8, 64
    )
    assert plan.replicated_fraction() == 1.0
    assert "100% of parameter bytes stay replicated" in plan.replication_warning()


def test_table_lists_every_parameter_and_totals(tiny_cfg, devices):
    from spmd.train import build_trainer

    plan = resolved(tiny_cfg, "fsdp_tp")
    table = sharding_lib.sharding_table(plan, build_trainer(tiny_cfg, plan).abstract_state["opt_state"])
    for p in plan.params:
        assert p.path in table
    assert "layers/attn/wq_DNH" in table and "P(-, fsdp, tensor, -)" in table
    assert "per device: params" in table and "optimizer state" in table
