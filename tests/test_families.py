"""Every built-in model family through the family contract alone (tests/family_checks.py),
parametrised over the families: parallel layouts equal one device, Hugging Face import
(transformers' logits), export (bit exact), greedy decoding, dry-run and plan; then what one
family alone has (GPT-2's learned position table)."""

import jax
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
from spmd.assembly.setup import assemble
from spmd.core import family
from spmd.core.errors import UserError
from spmd.io import hf

MOE = ["moe.n_experts=8", "moe.every=2", "moe.d_ff_expert=64"]  # layer 0 dense, layer 1 MoE
# family -> its config, its variants (name -> overrides), the layouts each trains under, its HF
# fixtures, and parameters whose gradient is zero in exact arithmetic (family_checks).
FAMILIES = {
    "gpt2": {
        "config": "tiny-gpt2",
        "variants": {"dense": ([], LAYOUTS)},
        "hf": ["gpt2"],
        "zero_gradient": ["layers/attn/bk_NH"],  # a key bias: softmax ignores it
    },
    "qwen3": {
        "config": "tiny-qwen3",
        "variants": {"dense": ([], LAYOUTS), "moe": (MOE, MOE_LAYOUTS)},
        "hf": ["qwen3", "qwen3_moe"],
    },
    # Llama's layouts (every preset) are tests/test_parity.py's and its five HF fixtures (Llama,
    # Llama 3.1 with RoPE scaling, Mistral, Qwen2, Mixtral) tests/test_hf.py's.
    "llama": {"config": "tiny", "variants": {"dense": ([], ()), "moe": (MOE, ())}, "hf": []},
}
VARIANTS = [(f, v) for f, spec in FAMILIES.items() for v in spec["variants"]]
CASES = [
    (f, v, rules, mesh)
    for f, spec in FAMILIES.items()
    for v, (_, layouts) in spec["variants"].items()
    for rules, mesh in layouts
]
HF = [(f, name) for f, spec in FAMILIES.items() for name in spec["hf"]]


def config(family_name: str, variant: str):
    spec = FAMILIES[family_name]
    return load_config(spec["config"], spec["variants"][variant][0])


def test_every_built_in_family_is_covered():
    assert sorted(FAMILIES) == family.builtin()
    for name, spec in FAMILIES.items():
        assert load_config(spec["config"]).model_family.name == name


@pytest.fixture(scope="module")
def references():
    cache = {}

    def reference(family_name, variant):
        if (family_name, variant) not in cache:
            cache[family_name, variant] = one_device(config(family_name, variant))
        return cache[family_name, variant]

    return reference


@pytest.mark.parametrize("family_name,variant,rules,mesh", CASES, ids=["-".join(c) for c in CASES])
def test_trains_like_one_device(devices, references, family_name, variant, rules, mesh):
    trains_like_one_device(
        config(family_name, variant), references(family_name, variant), rules, mesh,
        zero_gradient=FAMILIES[family_name].get("zero_gradient", ()),
    )  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for family_name, name in HF:
        done = hf.import_hf(str(FIXTURES / name), str(root / name), overrides=["model.dtype=float32"])
        assert done["config"].model_family.name == family_name
        assert (getattr(done["config"].model, "moe", None) is not None) == name.endswith("_moe")
    return root


@pytest.mark.parametrize("family_name,name", HF, ids=[n for _, n in HF])
def test_import_computes_transformers_logits(imported, family_name, name):
    imports_transformers_logits(imported / name, name)


@pytest.mark.parametrize("family_name,name", HF, ids=[n for _, n in HF])
def test_export_round_trip_is_bit_exact(imported, tmp_path, family_name, name):
    exports_bit_exact(imported / name, name, tmp_path / "out")


@pytest.mark.parametrize("family_name,name", HF, ids=[n for _, n in HF])
def test_greedy_decoding_equals_transformers_generate(imported, family_name, name):
    decodes_like_transformers(imported / name, name)


@pytest.mark.parametrize("family_name,variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_dry_runs_and_plans(devices, family_name, variant):
    spec = FAMILIES[family_name]
    dry_runs_and_plans(spec["config"], spec["variants"][variant][0])


def test_gpt2s_position_table_bounds_the_sequence(devices):
    with pytest.raises(UserError, match=r"train.seq_len \(128\) is longer than the 64 positions"):
        assemble("tiny-gpt2", "fsdp=8", "fsdp", overrides=["train.seq_len=128"])
    # The rows of the table take their own logical name, replicated unless a rules file maps it.
    plan = assemble("tiny-gpt2", "fsdp=8", "fsdp").plan
    (wpe,) = [p for p in plan.params if p.path == "wpe_PD"]
    assert wpe.logical == ("positions", "embed") and wpe.spec == jax.sharding.PartitionSpec(None, "fsdp")
