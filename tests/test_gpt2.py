"""The GPT-2 family (models/gpt2), through the family contract alone: parallel layouts equal one
device, Hugging Face GPT2LMHeadModel import (transformers' logits), export (bit exact), greedy
decoding, dry-run and plan; its learned position table bounds the sequence."""

import jax
import pytest
from family_checks import (
    LAYOUTS,
    decodes_like_transformers,
    dry_runs_and_plans,
    exports_bit_exact,
    imports_transformers_logits,
    one_device,
    trains_like_one_device,
)
from test_hf import FIXTURES

from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.io import hf


@pytest.fixture(scope="module")
def reference():
    return one_device(load_config("tiny-gpt2"))


@pytest.mark.parametrize("rules,mesh", LAYOUTS, ids=[f"{r}-{m}" for r, m in LAYOUTS])
def test_trains_like_one_device(devices, reference, rules, mesh):
    trains_like_one_device(
        load_config("tiny-gpt2"), reference, rules, mesh, zero_gradient=["layers/attn/bk_NH"]
    )


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpt2") / "run"
    done = hf.import_hf(str(FIXTURES / "gpt2"), str(run_dir), overrides=["model.dtype=float32"])
    assert done["architecture"] == "GPT2LMHeadModel" and done["config"].model_family.name == "gpt2"
    return run_dir


def test_import_computes_transformers_logits(imported):
    imports_transformers_logits(imported, "gpt2")


def test_export_round_trip_is_bit_exact(imported, tmp_path):
    exports_bit_exact(imported, "gpt2", tmp_path / "out")


def test_greedy_decoding_equals_transformers_generate(imported):
    decodes_like_transformers(imported, "gpt2")


def test_dry_runs_and_plans(devices):
    dry_runs_and_plans("tiny-gpt2")


def test_the_position_table_bounds_the_sequence(devices):
    with pytest.raises(UserError, match=r"train.seq_len \(128\) is longer than the 64 positions"):
        assemble("tiny-gpt2", "fsdp=8", "fsdp", overrides=["train.seq_len=128"])
    # The rows of the table take their own logical name, replicated unless a rules file maps it.
    plan = assemble("tiny-gpt2", "fsdp=8", "fsdp").plan
    (wpe,) = [p for p in plan.params if p.path == "wpe_PD"]
    assert wpe.logical == ("positions", "embed") and wpe.spec == jax.sharding.PartitionSpec(None, "fsdp")
