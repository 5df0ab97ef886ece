"""optimizer.name (adamw, adafactor, lion, muon, sgd), optimizer.state_dtype and
optimizer.offload: each trains under fsdp_tp on 8 devices as on one, the dry-run counts its
state (by dtype and memory kind), and a checkpoint keeps its optimizer: it restores onto another
mesh, and resuming it under another optimizer is an error."""

import jax
import numpy as np
import pytest
from conftest import run_training

from spmd import start as start_lib
from spmd.assembly.config import load_config
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.io import checkpoint as ckpt
from spmd.training.optimizer import lr_schedule

STEPS = 3
CASES = {
    "adafactor": ["optimizer.name=adafactor"],
    "lion": ["optimizer.name=lion", "optimizer.learning_rate=3e-4"],  # Lion's updates are sign(.) x lr
    "sgd": ["optimizer.name=sgd"],
    "muon": ["optimizer.name=muon"],
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
        bound = sum(float(lr_schedule(cfg.optimizer, cfg.train.steps)(s)) for s in range(STEPS)) * 2**-8
        tol = {"rtol": 0, "atol": bound}
    else:
        tol = {"rtol": 1e-4, "atol": 1e-6}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(one_params)):
        np.testing.assert_allclose(a, b, **tol, err_msg=jax.tree_util.keystr(path))


def test_state_dtype_halves_the_first_moment_in_the_dry_run(devices):
    from spmd.analysis import aot
    from spmd.parallel import sharding

    fp32 = assemble("tiny", "fsdp=8", "fsdp")
    bf16 = assemble("tiny", "fsdp=8", "fsdp", overrides=["optimizer.state_dtype=bfloat16"])
    params = fp32.plan.param_bytes_per_device
    opt32 = sharding.tree_bytes_per_device(fp32.trainer.abstract_state["opt_state"])
    opt16 = sharding.tree_bytes_per_device(bf16.trainer.abstract_state["opt_state"])
    assert opt32 - opt16 == params // 2  # mu in bf16; nu stays in the parameters' dtype
    assert aot.dry_run(bf16)["per_device_bytes"]["optimizer_state"] == opt16


def test_a_checkpoint_keeps_its_optimizer(devices, tmp_path):
    cfg = load_config("tiny", CASES["lion"])
    saved = assemble(cfg, "fsdp=8", "fsdp", devices=devices)
    batches = saved.batches()
    state = saved.trainer.init_state()
    writer = ckpt.Checkpointer(tmp_path, cfg.checkpoint)
    writer.save(0, state, ckpt.step_meta(0, batches, cfg.train, saved.to_json()))
    writer.close()
    other = assemble(cfg, "fsdp=4,tensor=2", "fsdp_tp", devices=devices)
    start = start_lib.resume_or_init(other.trainer, other.batches(), tmp_path)
    for a, b in zip(jax.tree.leaves(start.state["opt_state"]), jax.tree.leaves(state["opt_state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adamw = assemble("tiny", "fsdp=8", "fsdp", devices=devices)
    with pytest.raises(UserError, match="trained with optimizer.name = 'lion', this run asks for 'adamw'"):
        start_lib.resume_or_init(adamw.trainer, adamw.batches(), tmp_path)


def test_muon_orthogonalises_a_split_matrix_as_the_whole_matrix(devices):
    """Newton-Schulz on (layers, embed, mlp) momentum split over fsdp and tensor: GSPMD runs the
    iteration's matmuls on the shards (with collectives) and must give the unsharded result."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    auto = jax.sharding.AxisType.Auto  # GSPMD decides the collectives, as in training
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(auto, auto), devices=devices)
    split = NamedSharding(mesh, PartitionSpec(None, "fsdp", "tensor"))
    dims = optax.contrib.MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))
    tx = optax.contrib.scale_by_muon(weight_dimension_numbers=dims)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((2, 64, 192)).astype(np.float32) for _ in range(2)]

    def two_steps(sharding):
        put = (lambda x: jax.device_put(x, sharding)) if sharding else jax.numpy.asarray
        step = jax.jit(tx.update)
        state, out = tx.init(put(grads[0])), []
        for g in grads:
            update, state = step(put(g), state)
            out.append(update)
        return out

    whole = two_steps(None)
    sharded = two_steps(split)
    assert sharded[0].sharding.spec == split.spec  # it really ran on the shards
    hlo = jax.jit(tx.update).lower(jax.device_put(grads[0], split), tx.init(jax.device_put(grads[0], split)))
    assert "all-reduce" in hlo.compile().as_text()  # the shards' partial products are summed
    for a, b in zip(sharded, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # And the update is orthogonalised: singular values of each matrix near 1 (Muon's quintic
    # iteration puts them in roughly [0.7, 1.2]), not the gradient's.
    s = np.linalg.svd(np.asarray(whole[0])[0], compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.3


def test_offloaded_optimizer_state_lives_in_host_memory_and_changes_nothing(devices, tmp_path):
    """optimizer.offload on fsdp_tp: the state is pinned_host arrays, the compiled step takes and
    returns it in host memory space (S(5) in XLA's entry layout), training is bit-identical, the
    dry-run moves its bytes from the device peak to `host`, and its checkpoint restores onto a
    mesh without offload."""
    from spmd.analysis import aot

    plain = assemble("tiny", "fsdp=4,tensor=2", "fsdp_tp", devices=devices)
    off = assemble(
        "tiny", "fsdp=4,tensor=2", "fsdp_tp", overrides=["optimizer.offload=true"], devices=devices
    )
    batches = plain.batches()
    a, b = plain.trainer.init_state(), off.trainer.init_state()
    for step in range(2):
        a, _ = plain.trainer.train_step(a, batches.train_batch(step))
        b, _ = off.trainer.train_step(b, batches.train_batch(step))
    opt_leaves = jax.tree.leaves(b["opt_state"])
    assert {x.sharding.memory_kind for x in opt_leaves} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(b["params"])} == {"device"}
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    compiled = off.trainer.train_step.lower(
        off.trainer.abstract_state, off.trainer.abstract_batch(8, 64)
    ).compile()
    layout = compiled.as_text().split("entry_computation_layout={", 1)[1].split("\n", 1)[0]
    args, results = layout.split(")->", 1)
    assert args.count("S(5)") == len(opt_leaves) and results.count("S(5)") == len(opt_leaves)

    r_plain, r_off = aot.dry_run(plain)["per_device_bytes"], aot.dry_run(off)
    host = r_off["per_device_bytes"]["host"]
    assert host == r_plain["optimizer_state"] > 0 and r_plain["host"] == 0
    assert r_off["per_device_bytes"]["peak"] == r_plain["peak"] - host
    assert set(r_off["optimizer_state_by_kind"]) == {"float32 pinned_host", "int32 pinned_host"}

    writer = ckpt.Checkpointer(tmp_path, off.cfg.checkpoint)
    writer.save(2, b, ckpt.step_meta(2, batches, off.cfg.train, off.to_json()))
    writer.close()
    other = assemble("tiny", "fsdp=8", "fsdp", devices=devices)
    start = start_lib.resume_or_init(other.trainer, other.batches(), tmp_path)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(start.state["opt_state"])} == {"device"}
    for x, y in zip(jax.tree.leaves(start.state), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_remat_offload_is_an_error_where_programs_cannot_move_data_to_the_host(devices):
    """XLA:CPU has host memory for arrays but JAX lowers a move to it inside a program only for
    TPU and GPU: model.remat = offload_dots would silently keep the residuals on the device."""
    from spmd.parallel import memory

    mesh = jax.make_mesh((8,), ("fsdp",), devices=devices)
    assert memory.host_memory_kinds(mesh) and not memory.moves_inside_programs(mesh)
    with pytest.raises(UserError, match="model.remat = offload_dots needs a backend that moves activations"):
        assemble("tiny", "fsdp=8", "fsdp", overrides=["model.remat=offload_dots"], devices=devices)
