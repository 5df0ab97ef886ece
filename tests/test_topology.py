"""spmd-dryrun --topology: the train step compiled by the TPU compiler (libtpu, the `tpu` extra)
for a named slice on this CPU-only machine, and what that shows that XLA:CPU cannot: its
collectives, its memory (with host offload), and its refusal of what does not fit."""

import importlib.util

import pytest

from spmd.core.errors import UserError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs the tpu extra: pip install '.[tpu]'"
)


@pytest.fixture(scope="module")
def v5e():
    from spmd.analysis import topology

    return topology.devices("v5e:2x2")


def dry(devices, mesh, rules, *overrides, config="tiny"):
    from spmd.analysis.aot import dry_run
    from spmd.assembly.setup import assemble

    return dry_run(assemble(config, mesh, rules, overrides=list(overrides), devices=devices), explain=True)


def kinds(r, axis):
    return {c["kind"] for c in r["collectives"] if axis in c["axes"]}


def test_the_tpu_compiler_reduce_scatters_what_xla_cpu_all_reduces(v5e, devices):
    """fsdp on 4 chips, at a width where the TPU compiler's reduce-scatter creator applies: the
    gradients are reduce-scattered over fsdp; XLA:CPU all-reduces them. The chip's figures come
    with it: its HBM per device and a roofline estimate."""
    wide = ("model.d_model=256", "model.d_ff=512", "model.n_heads=8", "model.head_dim=32")
    tpu = dry(v5e, "fsdp=4", "fsdp", *wide)
    cpu = dry(devices[:4], "fsdp=4", "fsdp", *wide)
    assert tpu["platform"] == "tpu" and tpu["device_kind"] == "TPU v5 lite"
    assert "reduce-scatter" in kinds(tpu, "fsdp") and "reduce-scatter" not in kinds(cpu, "fsdp")

    def all_reduced(r):
        return sum(c["volume_bytes"] for c in r["collectives"] if c["kind"] == "all-reduce")

    assert all_reduced(tpu) < all_reduced(cpu) / 2  # the gradients are no longer all-reduced
    # --explain reads the TPU compiler's HLO too: its reduce-scatters are the gradients.
    why = {(r["rule"], r["what"]) for r in tpu["explain"]["rules"] if r["kind"] == "reduce-scatter"}
    assert why == {("batch -> fsdp", "gradients reduced")}
    est = tpu["chip_estimate"]
    assert est["chip"] == "tpu-v5e" and est["hbm_per_device"] == 16 * 2**30 and est["fits"]
    assert est["step_s"] == pytest.approx(est["compute_s"] + est["comm_s"]) and 0 < est["mfu"] < 1
    assert cpu["chip_estimate"] is None


def test_sharded_weight_update_reduce_scatters_on_tpu_and_sends_what_dp_sends(v5e):
    """dp_zero1 with the TPU compiler: gradients reduce-scattered over data, updated
    parameters all-gathered, and about the bytes plain dp sends (XLA:CPU all-reduces and slices:
    1.5x). Plain dp's all-reduce is the analytic minimum exactly."""
    wide = ("model.d_model=256", "model.d_ff=512", "model.n_heads=8", "model.head_dim=32")
    dp, zero = dry(v5e, "data=4", "dp", *wide), dry(v5e, "data=4", "dp_zero1", *wide)
    assert dp["collective_volume_bytes"] == pytest.approx(dp["analytic_minimum_total"], rel=1e-3)
    assert {"reduce-scatter", "all-gather"} <= kinds(zero, "data")
    assert zero["collective_volume_bytes"] <= 1.1 * dp["collective_volume_bytes"]
    assert zero["per_device_bytes"]["optimizer_state"] <= 1.05 * dp["per_device_bytes"]["optimizer_state"] / 4


def test_a_bf16_models_gradients_are_reduced_in_bf16_as_the_minimum_counts(v5e, devices):
    """The analytic minimum counts a cast weight's gradient in the compute dtype, because that is
    the dtype it leaves the matmuls in: the TPU compiler's dp all-reduce of a bf16 model sends
    exactly that; XLA:CPU, which computes bf16 in fp32, sends about twice as much."""
    wide = ("model.d_model=256", "model.d_ff=512", "model.n_heads=8", "model.head_dim=32")
    tpu = dry(v5e, "data=4", "dp", *wide, "model.dtype=bfloat16")
    cpu = dry(devices[:4], "data=4", "dp", *wide, "model.dtype=bfloat16")
    fp32 = dry(v5e, "data=4", "dp", *wide)
    assert tpu["collective_volume_bytes"] == pytest.approx(tpu["analytic_minimum_total"], rel=1e-3)
    assert tpu["analytic_minimum_total"] < 0.6 * fp32["analytic_minimum_total"]
    assert cpu["collective_volume_bytes"] > 1.8 * cpu["analytic_minimum_total"]
    # train.grad_reduce_dtype = float32: the same bf16 model reduces its gradients in fp32 (the
    # projections' leave their matmuls in it, the table's is scatter-added in it), as counted
    wide32 = dry(v5e, "data=4", "dp", *wide, "model.dtype=bfloat16", "train.grad_reduce_dtype=float32")
    assert wide32["collective_volume_bytes"] == pytest.approx(wide32["analytic_minimum_total"], rel=1e-3)
    assert wide32["collective_volume_bytes"] == pytest.approx(fp32["collective_volume_bytes"], rel=1e-2)


def test_a_v5p_cube_is_asked_for_as_built_and_gathers_by_all_gather():
    """v5p:4x4x4 is a torus (every side wraps around, as the slice is built): one FSDP gather over
    all its 64 chips compiles to an all-gather. Asked for as an open grid, the compiler all-reduces
    zero-padded shards instead (twice the bytes). A whole-slice reduce-scatter is an all-reduce
    either way."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import mesh_utils, topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.analysis import hlo, topology

    spec = topology.slice_of("v5p:4x4x4")
    assert (spec.chip_config, spec.host_bounds, spec.wrap) == ("megacore", (2, 2, 1), (True,) * 3)
    assert topology.slice_of("v5p:2x4x4").wrap == (False,) * 3
    assert topology.slice_of("v5e:8x16").wrap == (False, True, False)

    def emitted(devices):
        mesh = Mesh(mesh_utils.create_device_mesh((64,), devices, allow_split_physical_axes=True), ("fsdp",))
        gather = jax.shard_map(
            lambda a: jax.lax.all_gather(a, "fsdp", axis=0, tiled=True) * 2,
            mesh=mesh, in_specs=P("fsdp"), out_specs=P(), check_vma=False,
        )  # fmt: skip
        scatter = jax.shard_map(
            lambda a: jax.lax.psum_scatter(a, "fsdp", scatter_dimension=0, tiled=True),
            mesh=mesh, in_specs=P(), out_specs=P("fsdp"), check_vma=False,
        )  # fmt: skip
        out = []
        for fn, spec_in in ((gather, P("fsdp")), (scatter, P())):
            arg = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, spec_in))
            out.append({c.kind for c in hlo.collectives(jax.jit(fn).lower(arg).compile().as_text(), mesh)})
        return out

    assert emitted(topology.devices("v5p:4x4x4")) == [{"all-gather"}, {"all-reduce"}]
    open_grid = topologies.get_topology_desc("v5p:4x4x4", "tpu").devices
    assert emitted(open_grid) == [{"all-reduce"}, {"all-reduce"}]


def test_collectives_over_a_whole_slice_run_as_all_reduces_and_are_counted_as_such():
    """Over every chip of a v5p:2x2x2 slice the TPU compiler reduce-scatters by all-reducing the
    whole array and keeping a shard (twice a reduce-scatter's bytes); --explain names those and
    the bytes they add, and without them dp_zero1 sends its analytic minimum: the gradient
    reduce-scattered (bf16) and the updated fp32 parameters gathered."""
    from spmd.analysis import explain, topology

    wide = (
        "model.d_model=256",
        "model.d_ff=512",
        "model.n_heads=8",
        "model.head_dim=32",
        "model.dtype=bfloat16",
    )
    r = dry(topology.devices("v5p:2x2x2"), "data=8", "dp_zero1", *wide)
    ex = r["explain"]
    as_ar = [row for row in ex["rules"] if row["what"] in explain.AS_ALL_REDUCE]
    assert as_ar and {row["kind"] for row in as_ar} == {"all-reduce"}
    assert ex["as_all_reduce_excess_bytes"] == pytest.approx(sum(row["volume_bytes"] for row in as_ar) / 2)
    one_way = r["collective_volume_bytes"] - ex["as_all_reduce_excess_bytes"]
    assert one_way == pytest.approx(r["analytic_minimum_total"], rel=0.01)
    assert r["collective_volume_bytes"] > 1.2 * r["analytic_minimum_total"]


@pytest.mark.parametrize(
    "mesh,rules,extra",
    [("data=2,tensor=2", "tp", ()), ("fsdp=4", "fsdp", ()), ("fsdp=4", "fsdp", ("model.dtype=bfloat16",))],
    ids=["tp", "fsdp", "fsdp-bf16"],
)
def test_tiny_sends_its_analytic_minimum_on_the_tpu_compiler(v5e, mesh, rules, extra):
    """The documented tolerance (docs/dryrun-and-planner.md): counted one-way, within 1.1x of the analytic minimum.
    tp: no gathers over tensor (the xla attention keeps batch and kv heads apart off CPU), the
    vocabulary's two (B, T, D) sums counted; fsdp: each async gather counted once, weights gathered
    twice in the dtype the matmuls read (bf16 on TPU for fp32 weights too)."""
    wide = ("model.d_model=256", "model.d_ff=512", "model.n_heads=8", "model.head_dim=32", *extra)
    r = dry(v5e, mesh, rules, *wide)
    one_way = r["collective_volume_bytes"] - r["explain"]["as_all_reduce_excess_bytes"]
    assert 0.95 <= one_way / r["analytic_minimum_total"] <= 1.1
    if rules == "tp":
        assert kinds(r, "tensor") == {"all-reduce"}
        assert r["collective_volume_bytes"] == pytest.approx(r["analytic_minimum_total"], rel=0.01)


def test_a_dry_run_found_in_the_persistent_cache_compiles_again_without_a_warning(v5e, recwarn):
    """The suite runs with JAX's persistent compilation cache on (conftest): the second dry-run of
    the same program finds it there, cannot load it on compile-only devices and compiles again,
    and the user is not told about it."""
    import os

    assert os.environ.get("JAX_COMPILATION_CACHE_DIR")
    first, second = dry(v5e, "fsdp=4", "fsdp"), dry(v5e, "fsdp=4", "fsdp")
    assert second["collective_volume_bytes"] == first["collective_volume_bytes"]
    assert not [w for w in recwarn if "persistent compilation cache" in str(w.message)]


def test_two_slices_compile_with_the_dcn_mesh_across_them():
    """--num-slices 2: the mesh's data axis spans the slices (by slice_index); the cross-slice
    transfers (send/recv, not collectives in the HLO) are counted apart, by dtype."""
    from spmd.analysis import topology

    devices = topology.devices("v5e:2x2", num_slices=2)
    assert len(devices) == 8 and {d.slice_index for d in devices} == {0, 1}
    from spmd.analysis.aot import dry_run
    from spmd.assembly.setup import assemble

    s = assemble("tiny", "fsdp=4", "fsdp", devices=devices, dcn_mesh="data=2")
    assert s.mesh.shape["data"] == 2  # data index i holds exactly slice i's chips
    by_data = [s.mesh.devices.take(i, axis=s.mesh.axis_names.index("data")) for i in range(2)]
    assert [{d.slice_index for d in part.flat} for part in by_data] in ([{0}, {1}], [{1}, {0}])
    r = dry_run(s)
    assert r["notes"] == [
        "2 slices: transfers between slices (DCN) are not in the collectives below (see between slices)"
    ]
    between = r["between_slices"]
    assert (
        between["slices"] == 2 and between["sent_bytes_per_step"] > 0 and not between["sent_bytes_per_sync"]
    )
    # the gradients cross in float32 (tiny computes in float32): no less than the analytic all-reduce
    assert between["by_dtype"]["f32"] >= between["analytic_allreduce_bytes_per_step"]
    assert r["chip_estimate"]["dcn_axes"] == ["data"]


def test_host_offload_is_compiled_for_tpu_and_counted_in_host_memory(v5e):
    """Where the backend moves data between memories (TPU), the optimizer state and remat
    residuals go to pinned_host: the compiler's own host figures hold them and the device's
    arguments drop by the state's size. (On XLA:CPU remat offload is an error: test_optimizers.)"""
    plain = dry(v5e, "fsdp=4", "fsdp")
    off = dry(v5e, "fsdp=4", "fsdp", "optimizer.offload=true", "model.remat=offload_dots")
    state = plain["per_device_bytes"]["optimizer_state"]
    # (TPU layouts pad small arrays to their tiles, so the device side drops by at least the
    # state's unpadded bytes.)
    assert plain["per_device_bytes"]["arguments"] - off["per_device_bytes"]["arguments"] >= state
    assert off["per_device_bytes"]["host"] > state  # the state plus the offloaded residuals


def test_a_step_that_cannot_fit_is_the_compilers_refusal_named(v5e):
    from spmd.analysis.aot import DoesNotFit

    with pytest.raises(DoesNotFit, match="does not fit TPU v5 lite: .*exceeds available HBM"):
        dry(v5e, "data=4", "dp", "train.global_batch_size=64", "train.seq_len=16384", config="small")


def test_over_hbm_compiles_what_does_not_fit_and_says_so():
    """--over-hbm (a fresh process: libtpu reads the option when it loads): a step that needs
    158 GiB per v5p chip (`tiny` widened to 7.6B parameters, replicated with their AdamW moments
    under dp; few tokens, so it compiles in seconds) is compiled, its peak is over the chip's HBM,
    and the report says so."""
    import json
    import subprocess
    import sys

    wide = [
        "model.d_model=16384",
        "model.d_ff=65536",
        "model.n_heads=128",
        "model.n_kv_heads=8",
        "model.head_dim=128",
    ]
    cmd = [sys.executable, "-m", "spmd.cli.dryrun", "--config", "tiny", "--topology", "v5p:2x2x1", "--mesh",
           "data=4", "--rules", "dp", "--set", "train.global_batch_size=4", *(a for w in wide for a in ("--set", w))]  # fmt: skip
    r = subprocess.run([*cmd, "--over-hbm", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    est = report["chip_estimate"]
    assert not est["fits"] and report["per_device_bytes"]["peak"] > est["hbm_per_device"]
    bad = subprocess.run(
        [*cmd[:3], "--over-hbm", "--host-devices", "4"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: --over-hbm needs --topology")


def test_topology_errors(monkeypatch, v5e):
    import subprocess
    import sys

    from spmd.analysis import topology
    from spmd.assembly.setup import assemble

    for name in ("bogus:2x2", "v5e", "v5e:0x2"):
        with pytest.raises(UserError, match="is not a TPU topology"):
            topology.devices(name)
    with pytest.raises(
        UserError, match="'v5e:3x3' is not a v5e slice; the nearest are v5e:2x2, v5e:2x4, v5e:4x4"
    ):
        topology.devices("v5e:3x3")
    with pytest.raises(UserError, match="the nearest are v5p:4x4x4, v5p:4x4x8, v5p:4x4x12"):
        topology.devices("v5p:8x4x4")  # sides are given smallest first
    with pytest.raises(UserError, match="--mesh fsdp=8 has 8 devices but 4 are available"):
        assemble("tiny", "fsdp=8", "fsdp", devices=v5e)
    cli = subprocess.run(
        [sys.executable, "-m", "spmd.cli.dryrun", "--config", "tiny", "--topology", "v9:2x2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 2 and cli.stderr.startswith("error: --topology 'v9:2x2' is not a TPU topology")
    assert len(cli.stderr.strip().splitlines()) == 1
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(UserError, match=r"pip install '.\[tpu\]'"):
        topology.devices("v5e:2x2")


KERNEL_CASES = [
    (1024, 1, True),
    (1024, 2, False),
    (1024, 4, True),
    (8192, 1, False),
    (8192, 2, True),
    (8192, 4, True),
]


@pytest.mark.parametrize(
    "T,groups,causal", KERNEL_CASES, ids=[f"T{t}-G{g}-causal{c}" for t, g, c in KERNEL_CASES]
)
def test_pallas_flash_attention_compiles_for_tpu(T, groups, causal):
    """The flash kernel's TPU block layout lowers through Mosaic: forward and both backward
    kernels become three TPU custom calls (packed segments on the causal cases), within VMEM at 8k."""
    import jax
    import jax.numpy as jnp

    from spmd.analysis import hlo, topology
    from spmd.kernels.flash_attention import flash_attention

    chip = topology.devices("v5p:2x2x1")[0]
    on = jax.sharding.SingleDeviceSharding(chip)
    B, K, H = 1, 2, 128
    q = jax.ShapeDtypeStruct((B, T, K * groups, H), jnp.bfloat16, sharding=on)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=on)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=on) if causal else None

    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, causal=causal, segment_ids_BT=seg, interpret=False, tpu=True)
        return jnp.sum(out.astype(jnp.float32))

    # Mosaic reads the chip generation from the mesh in context when no TPU is attached.
    with jax.sharding.use_abstract_mesh(jax.sharding.Mesh([chip], ("x",)).abstract_mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
    # forward, dq, and one dk/dv whose grid runs over the query heads of a kv head's group
    assert hlo.kernel_calls(compiled.as_text()) == 3


def test_attention_auto_is_splash_in_a_tpu_train_step():
    """auto -> splash on a TPU topology: a train step runs at most 4 attention kernels per layer
    (forward, forward again under recomputation, one fused backward); a context-parallel ring's
    blocks run the flash kernel's TPU layout (they need the log-sum-exp with its gradient)."""
    from spmd.analysis import hlo, topology
    from spmd.assembly.setup import assemble

    devices = topology.devices("v5p:2x2x1")
    wide = ["train.seq_len=1024", "model.head_dim=128", "model.dtype=bfloat16", "model.attention_impl=auto"]
    for mesh, rules, remat in (("fsdp=4", "fsdp", "full"), ("fsdp=2,context=2", "cp_ring", "save_dots")):
        s = assemble("tiny", mesh, rules, devices=devices, overrides=[*wide, f"model.remat={remat}"])
        assert s.attention.startswith("auto -> splash (Mosaic)")
        text = s.trainer.train_step.lower(
            s.trainer.abstract_state, s.trainer.abstract_batch(8, 1024)
        ).compile()
        calls = hlo.kernel_calls(text.as_text())
        if rules == "fsdp":
            assert 0 < calls <= 4 * s.cfg.model.n_layers and "splash" in text.as_text()
        else:
            assert calls >= 3 and "flash_attention_dkv" in text.as_text()
