"""Refactors that do not change the computation keep it bit-identical (torchtitan's rule).

The loss trajectories below were recorded before the run set-up was rewritten (spmd/setup.py) and
are compared exactly, float for float: `tiny` for 10 steps on one device and on fsdp=2 x tensor=2.
The resolved sharding presets are compared with what the flat preset files said before they were
rewritten as `extends` of a base.
"""

import json
import pathlib

from conftest import run_training

PINNED = {
    "one device": [
        5.609000205993652,
        5.593022346496582,
        5.565330505371094,
        5.541919708251953,
        5.464084625244141,
        5.402177333831787,
        5.276096820831299,
        5.179218769073486,
        5.008785724639893,
        4.69998836517334,
    ],
    # Re-recorded once (2026-12-01, issue 19): the CPU attention's own backward
    # (models.attention.softmax_attention_cpu) sums in another order; step 8 moved by 1 ulp
    # (5.179219722747803 before). The one-device trajectory did not move.
    "fsdp=2,tensor=2": [
        5.609000205993652,
        5.593021392822266,
        5.56533145904541,
        5.5419206619262695,
        5.464085102081299,
        5.402176856994629,
        5.276095390319824,
        5.1792192459106445,
        5.008784294128418,
        4.69998836517334,
    ],
}
GOLDEN_RULES = pathlib.Path(__file__).parent / "golden" / "rules_resolved.json"


def test_tiny_loss_on_one_device_is_bit_identical(single_device_run):
    losses, _, _ = single_device_run
    assert [float(x) for x in losses] == PINNED["one device"]


def test_tiny_loss_on_fsdp_tensor_is_bit_identical(tiny_cfg, devices):
    losses, _, _ = run_training(tiny_cfg, "fsdp=2,tensor=2", "fsdp_tp", 10, devices=devices[:4])
    assert [float(x) for x in losses] == PINNED["fsdp=2,tensor=2"]


def test_every_preset_resolves_to_its_recorded_table():
    from spmd.rules import load_rules, presets

    golden = json.loads(GOLDEN_RULES.read_text())
    assert set(golden) <= set(presets())
    for name, want in golden.items():
        r = load_rules(name)
        got = {
            "replicated_params_ok": r.replicated_params_ok,
            "context_parallel": r.context_parallel,
            "load_balance": r.load_balance,
            "rules": {k: list(v) for k, v in sorted(r.mapping.items())},
        }
        assert got == want, name
