"""Every preset on 8 devices trains `tiny` exactly like one device (fp32): data, FSDP, tensor,
sequence and context parallelism and their combinations."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import run_training

from spmd.core.rules import load_rules

LAYOUTS = [
    ("dp", "data=8"),
    # The sharded weight update (ZeRO-1/2): optimizer state split over data.
    ("dp_zero1", "data=8"),
    ("tp_zero1", "data=4,tensor=2"),
    ("fsdp", "fsdp=8"),
    ("tp", "data=4,tensor=2"),
    ("fsdp_tp", "fsdp=4,tensor=2"),
    ("fsdp_tp", "data=2,fsdp=2,tensor=2"),
    # Megatron sequence parallelism.
    ("tp_sp", "data=4,tensor=2"),
    ("fsdp_tp_sp", "fsdp=4,tensor=2"),
    # Context parallelism (the sequence split over `context`), alone and with fsdp and tensor.
    ("cp_ring", "context=8"),
    ("cp_ring", "fsdp=2,context=4"),
    ("cp_ring", "fsdp=2,tensor=2,context=2"),
    ("cp_ulysses", "data=4,context=2"),
    ("cp_ulysses", "fsdp=4,context=2"),
    ("allgather", "fsdp=2,context=4"),
    ("cp_ring:striped", "data=2,context=4"),
    ("cp_ring:zigzag:pallas", "data=2,context=4"),  # ring blocks by the flash kernel (interpret mode)
]


@pytest.mark.parametrize("rules,mesh", LAYOUTS, ids=[f"{r}-{m}" for r, m in LAYOUTS])
def test_matches_single_device(tiny_cfg, single_device_run, devices, rules, mesh):
    ref_losses, ref_params, _ = single_device_run
    rules, _, variant = rules.partition(":")
    layout, _, impl = variant.partition(":")
    cfg = tiny_cfg
    if layout:  # the rules' context-parallel key
        rules = dataclasses.replace(load_rules(rules), load_balance=layout)
    if impl:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl))
    losses, params, trainer = run_training(cfg, mesh, rules, 10)
    assert trainer.plan.mesh.size == 8
    assert losses[-1] < losses[0] - 0.5, "tiny should learn within 10 steps"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
