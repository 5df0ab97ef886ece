"""Across slices with little traffic ([sync], spmd/parallel/slices.py): DiLoCo that reduces to data
parallelism is data parallelism; compressed sums are what their algebra says; what crosses the
slow axis is sent in the compressed dtype; a run resumes exactly mid-interval; bad settings are
one error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from spmd.analysis import hlo
from spmd.assembly.setup import assemble
from spmd.core.errors import UserError
from spmd.core.mesh import build_mesh
from spmd.io import checkpoint as ckpt
from spmd.parallel import slices as slices_lib

SIM = ["sync.axes=data"]  # slices simulated in one process: the data axis is the slow one


def train(setup, state, steps):
    trainer, batches = setup.trainer, setup.batches()
    losses = []
    for step in steps:
        state, m = trainer.train_step(state, batches.train_batch(step))
        losses.append(float(m["loss"]))
    return state, np.array(losses)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_diloco_of_one_sgd_step_with_outer_lr_one_is_data_parallel_sgd(devices):
    """H = 1, outer lr 1, no outer momentum, plain SGD inside: the anchor moves by the mean of the
    slices' SGD steps, which is data-parallel SGD. Not bit for bit: the outer gradient is
    anchor - (anchor - lr g), which rounds lr g once more."""
    sgd = ["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.grad_clip=0"]
    diloco = SIM + ["sync.method=diloco", "sync.inner_steps=1", "sync.outer_lr=1", "sync.outer_momentum=0"]
    plain = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=sgd)
    outer = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=sgd + diloco)
    want_state, want = train(plain, plain.trainer.init_state(), range(3))
    got_state, got = train(outer, outer.trainer.init_state(), range(3))
    assert set(got_state["sync"]) == {"replicas", "momentum"}
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(host(got_state["params"])), jax.tree.leaves(host(want_state["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_one_slice_is_the_plain_step(devices):
    """One slice: nothing crosses, so [sync] leaves the step as it is (the one-device step)."""
    s = assemble("tiny", "fsdp=8", "fsdp", overrides=SIM + ["sync.method=diloco", "sync.compress=int8"])
    assert s.cfg.sync.axes == "" and "sync" not in s.trainer.state_shardings


def _mesh():
    return build_mesh("data=2,fsdp=4")


def test_powersgd_at_full_rank_is_the_exact_sum_and_its_residuals_sum_to_what_it_lost(devices):
    mesh = _mesh()
    slices = slices_lib.Slices(mesh, ("data",))
    rng = np.random.default_rng(0)
    m_n = jnp.asarray(rng.normal(size=(2, 3, 8, 6)), jnp.float32)  # 2 slices x 3 stacked 8x6 matrices
    rows_n = {"w": jax.device_put(m_n, NamedSharding(mesh, PartitionSpec("data")))}
    residual = {"w": jnp.zeros_like(m_n)}

    def summed(rank):
        view = {"w": slices_lib.MatrixView((3, 8, 6), 1, True)}
        q = {"m000": jnp.asarray(rng.normal(size=(3, 6, rank)), jnp.float32)}
        return jax.jit(lambda r, e, q: slices_lib.powersgd_sum(r, e, q, view, slices, rank))(
            rows_n, residual, q
        )

    total, res, _ = summed(6)  # rank = the columns: P Q^T spans every matrix
    np.testing.assert_allclose(total["w"], m_n.sum(0), rtol=1e-4, atol=1e-5)
    total, res, q = summed(1)
    lost = m_n.sum(0) - total["w"]
    assert float(jnp.abs(lost).max()) > 0.1  # rank 1 of a random 8x6 loses much
    # each slice keeps its input less its share of the approximated sum: together, what was lost
    np.testing.assert_allclose(res["w"].sum(0), lost, rtol=1e-5, atol=1e-5)
    assert q["m000"].shape == (3, 6, 1)


@pytest.mark.parametrize("compress", ["int8", "bf16"])
def test_cast_sums_round_each_slice_once_and_feed_the_rounding_back(devices, compress):
    mesh = _mesh()
    slices = slices_lib.Slices(mesh, ("data",))
    rng = np.random.default_rng(1)
    x_n = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
    e_n = jnp.asarray(rng.normal(size=(2, 16, 32)) * 1e-3, jnp.float32)
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    total, res = jax.jit(lambda x, e: slices_lib.cast_sum(x, e, compress, slices, sharding))(x_n, e_n)
    m_n = x_n + e_n
    # what was sent, summed, is exactly the inputs less what each slice keeps for its next step;
    # a bf16 all-reduce adds in bf16, so its sum (of two slices: one addition) rounds once more
    sent = (m_n - res).sum(0)
    want = sent.astype(jnp.bfloat16).astype(jnp.float32) if compress == "bf16" else sent
    np.testing.assert_allclose(total, want, rtol=1e-6, atol=1e-6)
    bound = (np.abs(m_n).max(-1, keepdims=True) / 254 if compress == "int8" else np.abs(m_n) / 256).max()
    assert 0 < float(jnp.abs(res).max()) <= bound * 1.0001


def _cross_slice(setup):
    trainer = setup.trainer
    text = trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch(8, 64)).compile().as_text()
    return [c for c in hlo.collectives(text, setup.mesh) if c.axes == ("data",)]


def test_int8_crosses_the_slow_axis_as_int8_and_only_the_slices_own_shards(devices):
    setup = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=SIM + ["sync.compress=int8"])
    crossing = _cross_slice(setup)
    assert all(c.kind == "all-gather" for c in crossing if c.bytes > 16)  # beyond the loss's scalars
    sent = {dt: sum(c.bytes * c.count for c in crossing if c.dtypes == (dt,)) for dt in ("s8", "f32")}
    assert sent["s8"] > 4 * sent["f32"]  # the values as int8; their scales are the float32 rest
    # the MLP's gradient: each device gathers its own block (2 layers x 64/4 x 192) from both slices
    assert any(c.shapes == ((2, 2, 16, 192),) and c.dtypes == ("s8",) for c in crossing)


def test_diloco_resumes_exactly_from_a_checkpoint_between_syncs(devices, tmp_path):
    over = SIM + ["sync.method=streaming_diloco", "sync.inner_steps=4", "sync.fragments=2",
                  "sync.compress=int8", "train.steps=6"]  # fmt: skip
    setup = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=over)
    state, first = train(setup, setup.trainer.init_state(), range(3))
    writer = ckpt.Checkpointer(tmp_path, ckpt.CheckpointConfig())
    writer.save(3, state, {"step": 3, "consumed_samples": 24, "global_batch_size": 8})
    writer.close()
    _, rest = train(setup, state, range(3, 6))
    again = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=over)
    restored, _ = ckpt.restore(tmp_path / ckpt.SUBDIR, 3, again.trainer.abstract_state)
    assert set(restored["sync"]) == {"replicas", "momentum", "residual"}
    _, resumed = train(again, restored, range(3, 6))
    np.testing.assert_array_equal(resumed, rest)


BAD = [
    (["sync.method=diloco"], "fsdp=8", "needs slow axes to sync across: run across slices with --dcn-mesh"),
    (["sync.axes=fsdp", "sync.compress=int8"], "fsdp=8", "split the parameter"),
    (
        SIM + ["sync.compress=powersgd", "sync.rank=64"],
        "data=2,fsdp=4",
        "sync.rank = 64 compresses no matrix",
    ),
    (
        SIM + ["sync.method=diloco", "sync.compress=powersgd"],
        "data=2,fsdp=4",
        "DiLoCo's outer gradient crosses as",
    ),
    (SIM + ["sync.fragments=2"], "data=2,fsdp=4", "needs sync.method = streaming_diloco"),
    (SIM + ["sync.compress=int8", "sync.start_step=5"], "data=2,fsdp=4", "delays PowerSGD only"),
    (["sync.axes=bogus", "sync.method=diloco"], "data=2,fsdp=4", "which is not a mesh axis"),
]


@pytest.mark.parametrize("over,mesh,message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_settings_that_cannot_apply_are_one_error(devices, over, mesh, message):
    with pytest.raises(UserError, match=message):
        assemble("tiny", mesh, "fsdp", overrides=over)


@pytest.mark.parametrize(
    "over",
    [["sync.compress=int8"], ["sync.method=streaming_diloco", "sync.inner_steps=8", "sync.fragments=2"]],
    ids=["int8", "streaming-diloco"],
)
def test_the_dry_run_counts_what_crosses_as_the_analytic_figure_says(devices, over):
    """Compiled (collectives over the slow axis; DiLoCo's syncs amortised over H) against
    spmd.parallel.slices.analytic_sent, within 5%; and --explain names every such collective."""
    from spmd.analysis import aot

    setup = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=SIM + over)
    report = aot.dry_run(setup, explain=True)
    bs = report["between_slices"]
    assert bs["slices"] == 2 and bs["amortised_bytes_per_step"] > 0
    assert abs(bs["amortised_bytes_per_step"] / bs["analytic_bytes_per_step"] - 1) < 0.05, bs
    assert bs["amortised_bytes_per_step"] < bs["analytic_allreduce_bytes_per_step"] / 3
    if "sync.method=streaming_diloco" in over:  # between syncs only the loss sums cross
        assert (
            bs["sent_bytes_per_step"] < 64
            and bs["sent_bytes_per_sync"] > 8 * bs["amortised_bytes_per_step"] / 2
        )
    assert not [u for u in report["explain"]["unexplained"] if u["axes"] == ["data"]]


def test_a_checkpoint_of_two_slices_onto_four_says_how_to_move_it(devices, tmp_path):
    over = SIM + ["sync.method=diloco", "sync.inner_steps=4"]
    two = assemble("tiny", "data=2,fsdp=4", "fsdp", overrides=over)
    writer = ckpt.Checkpointer(tmp_path, ckpt.CheckpointConfig())
    zeros = jax.tree.map(
        lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), two.trainer.abstract_saved
    )
    writer.save(0, zeros, {"step": 0, "consumed_samples": 0, "global_batch_size": 8})
    writer.close()
    four = assemble("tiny", "data=4,fsdp=2", "fsdp", overrides=over)
    with pytest.raises(
        UserError, match=r"has shape \(2,.*needs \(4,.*a \[sync\] state holds a row per slice.*--init-from"
    ):
        ckpt.restore(tmp_path / ckpt.SUBDIR, 0, four.trainer.abstract_state)


def test_the_planner_offers_a_sync_method_when_the_dcn_outlasts_the_compute(devices):
    from spmd.assembly import planner

    setup = assemble("tiny", "data=2,fsdp=4", "fsdp")
    hw = {"peak": 1e15, "ici": 4.5e11, "dcn": 1e9}
    slow, offers = planner.sync_offers(setup.cfg, {"setup": setup, "compute_s": 1e-6}, hw, 2)
    plain = slices_lib.analytic_sent(setup.cfg, setup.plan, 2)["allreduce"]
    assert slow == pytest.approx(plain / hw["dcn"]) and len(offers) == 3
    sent = {" ".join(setting): b for setting, b, _ in offers}
    assert sent["sync.method=diloco sync.inner_steps=32"] < sent["sync.compress=int8"] < plain / 3
    assert planner.sync_offers(setup.cfg, {"setup": setup, "compute_s": 10.0}, hw, 2) == (slow, [])
    assert planner.sync_offers(setup.cfg, {"setup": setup, "compute_s": 1e-6}, hw, 1) == (0.0, [])
