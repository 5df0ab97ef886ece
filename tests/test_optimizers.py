"""optimizer.name (adamw, adafactor, lion, sgd) and optimizer.state_dtype: each trains under
fsdp_tp on 8 devices as on one, the dry-run counts its state, and a checkpoint keeps its
optimizer: it restores onto another mesh, and resuming it under another optimizer is an error."""

import jax
import numpy as np
import pytest
from conftest import run_training

from spmd import checkpoint as ckpt
from spmd.config import load_config
from spmd.errors import UserError
from spmd.setup import assemble
from spmd.train import lr_schedule

STEPS = 3
CASES = {
    "adafactor": ["optimizer.name=adafactor"],
    "lion": ["optimizer.name=lion", "train.learning_rate=3e-4"],  # Lion's updates are sign(.) x lr
    "sgd": ["optimizer.name=sgd"],
    "adamw-bf16": ["optimizer.state_dtype=bfloat16"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_optimizer_trains_under_fsdp_tp_as_on_one_device(devices, case):
    cfg = load_config("tiny", CASES[case])
    one_losses, one_params, _ = run_training(cfg, "fsdp=1", "fsdp", STEPS, devices=devices[:1])
    losses, params, _ = run_training(cfg, "fsdp=4,tensor=2", "fsdp_tp", STEPS, devices=devices)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    if case == "adamw-bf16":
        # A bf16 first moment rounds the (fp32, reduction-order dependent) gradient sums to 8 bits,
        # so a value on a rounding boundary can land one bf16 ulp apart on the two layouts: each
        # step's update (at most lr in size for Adam) may then differ by lr x 2^-8.
        bound = sum(float(lr_schedule(cfg.train)(s)) for s in range(STEPS)) * 2**-8
        tol = {"rtol": 0, "atol": bound}
    else:
        tol = {"rtol": 1e-4, "atol": 1e-6}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(one_params)):
        np.testing.assert_allclose(a, b, **tol, err_msg=jax.tree_util.keystr(path))


def test_state_dtype_halves_the_first_moment_in_the_dry_run(devices):
    from spmd import dryrun, sharding

    fp32 = assemble("tiny", "fsdp=8", "fsdp")
    bf16 = assemble("tiny", "fsdp=8", "fsdp", overrides=["optimizer.state_dtype=bfloat16"])
    params = fp32.plan.param_bytes_per_device
    opt32 = sharding.tree_bytes_per_device(fp32.trainer.abstract_state["opt_state"])
    opt16 = sharding.tree_bytes_per_device(bf16.trainer.abstract_state["opt_state"])
    assert opt32 - opt16 == params // 2  # mu in bf16; nu stays in the parameters' dtype
    assert dryrun.dry_run(bf16)["per_device_bytes"]["optimizer_state"] == opt16


def test_a_checkpoint_keeps_its_optimizer(devices, tmp_path):
    cfg = load_config("tiny", CASES["lion"])
    saved = assemble(cfg, "fsdp=8", "fsdp", devices=devices)
    batches = saved.batches()
    state = saved.trainer.init_state()
    writer = ckpt.Checkpointer(tmp_path, cfg.checkpoint)
    writer.save(0, state, ckpt.step_meta(0, batches, cfg.train, saved.to_json()))
    writer.close()
    other = assemble(cfg, "fsdp=4,tensor=2", "fsdp_tp", devices=devices)
    start = ckpt.resume_or_init(other.trainer, other.batches(), tmp_path)
    for a, b in zip(jax.tree.leaves(start.state["opt_state"]), jax.tree.leaves(state["opt_state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adamw = assemble("tiny", "fsdp=8", "fsdp", devices=devices)
    with pytest.raises(UserError, match="trained with optimizer.name = 'lion', this run asks for 'adamw'"):
        ckpt.resume_or_init(adamw.trainer, adamw.batches(), tmp_path)
