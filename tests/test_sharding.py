"""Resolved shardings per preset against checked-in golden files; FSDP per-device bytes."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

from spmd.assembly.setup import assemble
from spmd.parallel import sharding as sharding_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = pathlib.Path(__file__).parent / "golden"
LAYOUTS = {"dp": "data=8", "fsdp": "fsdp=8", "tp": "data=4,tensor=2", "fsdp_tp": "data=2,fsdp=2,tensor=2"}


def resolved(cfg, rules_name):
    return assemble(cfg, LAYOUTS[rules_name], rules_name).plan


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
    setup = assemble(tiny_cfg, LAYOUTS["fsdp"], "fsdp")
    plan = setup.plan
    assert plan.param_bytes_per_device <= 1.05 * plan.param_bytes_total / 8
    # The per-device bytes are what the arrays really hold.
    state = setup.trainer.init_state()
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
    plan = assemble(tiny_cfg, "fsdp=8", str(tmp_path / "oops.toml")).plan
    assert plan.replicated_fraction() == 1.0
    assert "100% of parameter bytes stay replicated" in plan.replication_warning()


def test_table_lists_every_parameter_and_totals(tiny_cfg, devices):
    setup = assemble(tiny_cfg, LAYOUTS["fsdp_tp"], "fsdp_tp")
    plan = setup.plan
    table = sharding_lib.sharding_table(plan, setup.trainer.abstract_state["opt_state"])
    for p in plan.params:
        assert p.path in table
    assert "layers/attn/wq_DNH" in table and "P(-, fsdp, tensor, -)" in table
    assert "per device: params" in table and "optimizer state" in table


def test_weight_decay_follows_the_parameters_declaration(tiny_cfg, devices):
    """Norm scales declare weight_decay=False (models/layers.py); every matrix is decayed."""
    import jax

    from spmd.training.optimizer import decay_mask

    plan = resolved(tiny_cfg, "fsdp")
    mask = {
        "/".join(str(k.key) for k in path): v
        for path, v in jax.tree_util.tree_leaves_with_path(decay_mask(plan))
    }
    assert {p for p, decayed in mask.items() if not decayed} == {
        "layers/attn_norm/scale_D", "layers/mlp_norm/scale_D", "final_norm/scale_D",
    }  # fmt: skip
    assert all(info.weight_decay == ("norm" not in info.logical) for info in plan.params)


# Every shipped preset on a mesh that uses all its axes, on the test configs of each family (the
# partitioner's choices depend on the sharding pattern, not on the sizes).
PRESET_CASES = [
    ("tiny", "base", "data=8"), ("tiny", "dp", "data=8"), ("tiny", "dp_zero1", "data=8"),
    ("tiny", "fsdp", "data=2,fsdp=4"), ("tiny", "tp", "data=4,tensor=2"), ("tiny", "tp_zero1", "data=4,tensor=2"),
    ("tiny", "fsdp_tp", "data=2,fsdp=2,tensor=2"), ("tiny", "tp_sp", "data=4,tensor=2"),
    ("tiny", "fsdp_tp_sp", "fsdp=4,tensor=2"), ("tiny", "cp_ring", "fsdp=2,tensor=2,context=2"),
    ("tiny", "cp_ulysses", "fsdp=4,context=2"), ("tiny", "allgather", "fsdp=2,context=4"),
    ("tiny-moe", "ep", "data=2,expert=2,tensor=2"), ("tiny-moe", "fsdp_ep", "fsdp=2,expert=4"),
    ("tiny", "pp", "stage=2,data=4"), ("tiny", "pp_fsdp", "stage=2,fsdp=4"),
    ("tiny", "pp_fsdp_tp", "stage=2,fsdp=2,tensor=2"), ("tiny", "pp_fsdp_tp_sp", "stage=2,fsdp=2,tensor=2"),
    ("tiny-gpt2", "fsdp_tp", "fsdp=4,tensor=2"),
    ("tiny-gpt2", "pp_fsdp", "stage=2,fsdp=4"), ("tiny-qwen3", "fsdp_tp", "fsdp=4,tensor=2"),
]  # fmt: skip
COMPILE_ALL = """
import sys, jax
from spmd.core.rules import presets
from spmd.assembly.setup import assemble
cases = {cases!r}
assert {{r for _, r, _ in cases}} == set(presets()), "a preset without a case"
for cfg, rules, mesh in cases:
    print(f"case {{cfg}} {{rules}} {{mesh}}", file=sys.stderr, flush=True)
    s = assemble(cfg, mesh, rules)
    batch = s.trainer.abstract_batch(s.cfg.train.global_batch_size, s.cfg.train.seq_len)
    s.trainer.train_step.lower(s.trainer.abstract_state, batch).compile()
"""


def test_no_preset_leaves_the_partitioner_a_sharding_it_can_only_reach_by_replicating():
    """XLA's partitioner warns ("Involuntary full rematerialization") where it can reach a
    sharding the program asks for only by replicating a tensor and cutting it again: the lookup
    of an FSDP-split embedding table did so under fsdp x another axis. Compiled in a subprocess,
    where its log lines can be read."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    # LLVM at -O0, as the suite's own programs compile (conftest): the partitioner's choices, which
    # this test reads, are the same at every code generation level.
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_backend_optimization_level=0")  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_ALL.format(cases=PRESET_CASES)],
        capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    case = None
    for line in result.stderr.splitlines():
        case = line if line.startswith("case ") else case
        assert "Involuntary full rematerialization" not in line, f"{case}: {line[:600]}"
    assert case == "case " + " ".join(PRESET_CASES[-1])
