"""What every model family must do, as functions the families' test files call with their own
config and Hugging Face fixture: train under the parallel layouts exactly as on one device,
import transformers' weights to its logits, export them back bit for bit, decode greedily as
transformers generates, dry-run and plan."""

import json

import jax
import numpy as np
from conftest import run_training
from test_hf import FIXTURES, assert_close_to, hf_tensors_of, load, logits

from spmd.analysis import aot
from spmd.assembly import planner
from spmd.assembly.config import config_from_json, load_config
from spmd.assembly.setup import assemble
from spmd.io import checkpoint as ckpt
from spmd.io import hf

# The layouts every family trains under (an MoE family adds expert parallelism).
LAYOUTS = [
    ("fsdp", "fsdp=8"),
    ("fsdp_tp", "fsdp=4,tensor=2"),
    ("cp_ring", "fsdp=2,context=4"),
    ("pp_fsdp", "stage=2,fsdp=4"),
]
MOE_LAYOUTS = [("fsdp_ep", "fsdp=2,expert=4")]
STEPS = 8


def one_device(cfg):
    return run_training(cfg, "", "dp", STEPS, devices=jax.devices()[:1])


def trains_like_one_device(cfg, reference, rules: str, mesh: str, zero_gradient=()) -> None:
    """`zero_gradient`: parameters whose gradient is zero in exact arithmetic (a key bias: softmax
    ignores what adds the same logit to every key), so that what they hold is rounding noise, the
    same on every layout only to its own size: checked to stay that small instead."""
    ref_losses, ref_params, _ = reference
    losses, params, trainer = run_training(cfg, mesh, rules, STEPS)
    assert trainer.plan.mesh.size == 8 and trainer.plan.family.name == cfg.model_family.name
    assert losses[-1] < losses[0] - 0.2, "should learn within a few steps"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)):
        name = "/".join(str(k.key) for k in path)
        if name in zero_gradient:
            assert np.abs(a).max() < 1e-5 and np.abs(b).max() < 1e-5, name
            continue
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)


def imports_transformers_logits(run_dir, name: str) -> None:
    """On one device and on fsdp x tensor, the imported model computes transformers' logits."""
    ref = np.load(FIXTURES / name / "reference.npz")
    for mesh, rules, n in (("", "dp", 1), ("fsdp=2,tensor=2", "fsdp_tp", 4)):
        setup, params = load(run_dir, mesh, rules, devices=jax.devices()[:n])
        assert_close_to(logits(setup, params, ref["tokens"]), ref["logits"])


def exports_bit_exact(run_dir, name: str, out) -> None:
    hf.export_hf(str(run_dir), str(out))
    original, exported = hf_tensors_of(FIXTURES / name), hf_tensors_of(out)
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    before = json.loads((FIXTURES / name / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    assert hf.model_fields(after, "exported") == hf.model_fields(before, "original")


def decodes_like_transformers(run_dir, name: str) -> None:
    """Greedy KV-cache decoding on fsdp=2 equals transformers' generate."""
    from spmd.io.inference import Loaded, Sampler

    ref = np.load(FIXTURES / name / "reference.npz")
    directory, step = ckpt.locate(str(run_dir))
    cfg = config_from_json(ckpt.read_meta(directory, step)["run"]["config"])
    setup = assemble(
        cfg, "fsdp=2", "fsdp", devices=jax.devices()[:2], optimizer=False, decoding=True, batch_size=0
    )
    params, meta = ckpt.restore_params(directory, step, setup.plan.abstract_params)
    sampler = Sampler(Loaded(setup, step, meta, params))
    out = sampler.generate(list(ref["prompt"]), ref["greedy"].shape[1], temperature=0.0, top_k=0, seed=0)
    np.testing.assert_array_equal(np.stack(out), ref["greedy"])


def dry_runs_and_plans(config: str, overrides=()) -> None:
    cfg = load_config(config, overrides)
    report = aot.dry_run(assemble(cfg, "fsdp=4,tensor=2", "fsdp_tp"))
    figures = cfg.model_family.figures(cfg.model, cfg.train.seq_len)
    assert (
        report["model_flops_per_step"]
        == figures.flops_per_token * cfg.train.global_batch_size * cfg.train.seq_len
    )
    assert report["per_device_bytes"]["params"] < figures.params * 4  # sharded: less than whole
    found = planner.search(cfg, 8, 1 << 30, planner.hardware("h100"), candidates=2, max_compiles=3)
    assert found.ranked and all(r["setup"].plan.family is cfg.model_family for r in found.ranked)
