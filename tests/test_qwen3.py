"""The Qwen3 family (models/qwen3), dense and MoE, through the family contract alone: parallel
layouts equal one device, Hugging Face Qwen3ForCausalLM / Qwen3MoeForCausalLM import
(transformers' logits), export (bit exact), greedy decoding, dry-run and plan."""

import pytest
from family_checks import (
    LAYOUTS,
    MOE_LAYOUTS,
    decodes_like_transformers,
    dry_runs_and_plans,
    exports_bit_exact,
    imports_transformers_logits,
    one_device,
    trains_like_one_device,
)
from test_hf import FIXTURES

from spmd.assembly.config import load_config
from spmd.io import hf

MOE = ["moe.n_experts=8", "moe.every=2", "moe.d_ff_expert=64"]  # layer 0 dense, layer 1 MoE
HF_NAMES = ["qwen3", "qwen3_moe"]


@pytest.fixture(scope="module")
def reference():
    return {"dense": one_device(load_config("tiny-qwen3")), "moe": one_device(load_config("tiny-qwen3", MOE))}


CASES = [("dense", r, m) for r, m in LAYOUTS] + [("moe", r, m) for r, m in MOE_LAYOUTS]


@pytest.mark.parametrize("kind,rules,mesh", CASES, ids=[f"{k}-{r}-{m}" for k, r, m in CASES])
def test_trains_like_one_device(devices, reference, kind, rules, mesh):
    cfg = load_config("tiny-qwen3", MOE if kind == "moe" else [])
    trains_like_one_device(cfg, reference[kind], rules, mesh)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    for name in HF_NAMES:
        done = hf.import_hf(str(FIXTURES / name), str(root / name), overrides=["model.dtype=float32"])
        assert done["config"].model_family.name == "qwen3"
        assert (done["config"].model.moe is not None) == (name == "qwen3_moe")
    return root


@pytest.mark.parametrize("name", HF_NAMES)
def test_import_computes_transformers_logits(imported, name):
    imports_transformers_logits(imported / name, name)


@pytest.mark.parametrize("name", HF_NAMES)
def test_export_round_trip_is_bit_exact(imported, tmp_path, name):
    exports_bit_exact(imported / name, name, tmp_path / "out")


@pytest.mark.parametrize("name", HF_NAMES)
def test_greedy_decoding_equals_transformers_generate(imported, name):
    decodes_like_transformers(imported / name, name)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_dry_runs_and_plans(devices, kind):
    dry_runs_and_plans("tiny-qwen3", MOE if kind == "moe" else [])
