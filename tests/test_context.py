"""Context and sequence parallelism: ring, Ulysses and all-gather attention against one device
(forward and gradients), load balance, the collectives each mode compiles to, Megatron SP, errors."""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dryrun import report

from spmd.analysis import hlo
from spmd.core.mesh import build_mesh
from spmd.core.rules import load_rules
from spmd.kernels import ring_attention as ring
from spmd.kernels.flash_attention import attention_reference
from spmd.models.attention import xla_attention
from spmd.parallel import context
from spmd.parallel.sharding import activate

MODES = {"ring": "cp_ring", "ulysses": "cp_ulysses", "allgather": "allgather"}


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / np.abs(b).max()


def sharded_attention(mode, n, devices, causal, seg, layout=None):
    """Attention as the trainer runs it: sequence permuted for load balance, split over `context`."""
    mesh = build_mesh(f"context={n}", devices=devices[:n])
    rules = load_rules(MODES[mode])
    if layout:
        rules = dataclasses.replace(rules, load_balance=layout)

    def f(q, k, v):
        T = q.shape[1]
        perm = context.seq_permutation(rules, mesh, T)
        perm = np.arange(T) if perm is None else perm
        pos = jnp.broadcast_to(jnp.asarray(perm, jnp.int32), q.shape[:2])
        with activate(rules, mesh):
            out = context.context_attention(
                q[:, perm],
                k[:, perm],
                v[:, perm],
                pos,
                None if seg is None else seg[:, perm],
                causal=causal,
                local_impl=xla_attention,
            )
        return out[:, np.argsort(perm)]

    return jax.jit(f)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_forward_and_gradients_equal_one_device(devices, mode, n):
    rng = np.random.default_rng([n, list(MODES).index(mode)])
    B, T, K, G, H = 2, 64, 8, 2, 8  # 16 query heads, 8 kv heads: Ulysses splits both up to 8 ways
    for causal, with_segments in itertools.product([True, False], [False, True]):
        q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
        do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
        seg = (
            jnp.asarray(np.sort(rng.integers(0, 4, size=(B, T)), axis=1), jnp.int32)
            if with_segments
            else None
        )

        def ref(q, k, v):
            return attention_reference(q, k, v, causal=causal, segment_ids_BT=seg)[0]

        out_ref, vjp_ref = jax.vjp(ref, q, k, v)
        out, vjp = jax.vjp(sharded_attention(mode, n, devices, causal, seg), q, k, v)
        case = f"{mode} context={n} causal={causal} segments={with_segments}"
        assert rel_err(out, out_ref) <= 1e-5, case
        for name, g, g_ref in zip(("dq", "dk", "dv"), vjp(do), vjp_ref(do)):
            assert rel_err(g, g_ref) <= 1e-5, f"{case}: {name}"


@pytest.mark.parametrize(
    "n,causal,with_segments,tpu",
    [(4, True, True, False), (2, True, False, False), (2, False, True, False), (2, True, True, True)],
)
def test_ring_with_pallas_blocks_equals_one_device(devices, n, causal, with_segments, tpu):
    """The ring computing each block with the flash kernel (interpret mode here): fwd and grads;
    `tpu`: the kernel in its TPU block layout (what runs on TPU; the AOT compile is in test_topology)."""
    from spmd.kernels.flash_attention import BlockSizes

    rng = np.random.default_rng([n, causal, with_segments, tpu])
    B, T, K, G, H = 2, 64, 2, 2, 16
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.float32) for _ in range(2))
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), axis=1), jnp.int32) if with_segments else None
    mesh = build_mesh(f"context={n}", devices=devices[:n])
    perm = ring.layout_permutation(T, n, "zigzag")
    pos = jnp.broadcast_to(jnp.asarray(perm, jnp.int32), (B, T))

    def f(q, k, v):
        def local(q, k, v, pos, *seg):
            return ring.ring_flash_attention(
                q,
                k,
                v,
                pos,
                seg[0] if seg else None,
                axis_name="context",
                axis_size=n,
                causal=causal,
                sub_chunks=2,
                block_sizes=BlockSizes(16, 16, 16, 16),
                tpu=tpu,
            )

        spec = jax.sharding.PartitionSpec(None, "context")
        args = (q[:, perm], k[:, perm], v[:, perm], pos) + (() if seg is None else (seg[:, perm],))
        out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)(
            *args
        )
        return out[:, np.argsort(perm)]

    out_ref, vjp_ref = jax.vjp(
        lambda q, k, v: attention_reference(q, k, v, causal=causal, segment_ids_BT=seg)[0], q, k, v
    )
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    assert rel_err(out, out_ref) <= 1e-5
    for name, g, g_ref in zip(("dq", "dk", "dv"), vjp(do), vjp_ref(do)):
        assert rel_err(g, g_ref) <= 1e-5, name


def test_striped_and_contiguous_layouts_are_exact_too(devices):
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(1, 32, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 32, 2, 8)), jnp.float32) for _ in range(2))
    ref = attention_reference(q, k, v, causal=True)[0]
    for layout in ("striped", "contiguous"):
        assert rel_err(sharded_attention("ring", 4, devices, True, None, layout)(q, k, v), ref) <= 1e-5, (
            layout
        )


def test_zigzag_balances_causal_work():
    for n in (2, 4, 8):
        zigzag = ring.computed_blocks(256, n, "zigzag")
        assert max(zigzag) - min(zigzag) <= 1, zigzag
        # The same pieces in natural order: device i computes 4i+3 of them, the last 4(n-1) more than the first.
        contiguous = ring.computed_blocks(256, n, "contiguous", pieces=2)
        assert contiguous == [4 * i + 3 for i in range(n)]
        assert sum(zigzag) < sum(contiguous) + n  # balance costs no extra work: the same triangle
    # The ring really skips: its compiled forward branches on the skip test.
    text = (
        sharded_attention("ring", 4, jax.devices(), True, None)
        .lower(*(jnp.zeros((1, 32, 2, 8)),) * 3)
        .compile()
        .as_text()
    )
    assert "conditional" in text


def _hlo(mesh, rules, *sets):
    from spmd.assembly.setup import assemble

    trainer = assemble("tiny", mesh, rules, overrides=sets).trainer
    return trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch(8, 64)).compile().as_text()


def _collective_lines(text, kind):
    return [line for line in text.splitlines() if re.search(rf"= \S+ {kind}(-start)?\(", line)]


def _counts(r):
    return {(c["kind"], tuple(c["axes"])): c["count"] for c in r["collectives"]}


def test_ring_permutes_kv_and_never_gathers_it(devices):
    r = report("data=2,context=4", "cp_ring")
    counts = _counts(r)
    assert counts[("collective-permute", ("context",))] > 0
    assert not any(kind == "all-to-all" for kind, _ in counts)
    # The only all-gathers over context are of the int32 token ids (the load-balance permutation).
    gathers = _collective_lines(_hlo("data=2,context=4", "cp_ring"), "all-gather")
    assert gathers and all(re.search(r"= s32\[4,64\]", g) for g in gathers), gathers


def test_ulysses_uses_all_to_all_and_allgather_gathers(devices):
    ulysses = _counts(report("data=4,context=2", "cp_ulysses"))
    assert ulysses[("all-to-all", ("context",))] > 0
    assert ("collective-permute", ("context",)) not in ulysses
    allgather = _counts(report("data=2,context=4", "allgather"))
    assert allgather[("all-gather", ("context",))] > 0
    assert allgather[("reduce-scatter", ("context",))] > 0  # the gather's transpose, in the backward


def test_sequence_parallel_gathers_and_scatters_activations(devices):
    """Megatron SP: the residual is split along the sequence over tensor, so each layer gathers it
    before attention/MLP and reduce-scatters their outputs. XLA:CPU has no reduce-scatter creator
    pass: the reduce-scatter appears as an all-reduce whose only use is a dynamic-slice fusion."""
    mesh = build_mesh("data=4,tensor=2")
    tp, sp = _hlo("data=4,tensor=2", "tp"), _hlo("data=4,tensor=2", "tp_sp")
    residual = r"= f32\[2,64,64\]"  # one device's residual stream, (B/data, T, D), gathered over T
    assert not [g for g in _collective_lines(tp, "all-gather") if re.search(residual, g)]
    assert len([g for g in _collective_lines(sp, "all-gather") if re.search(residual, g)]) >= 4

    def activation_reduces(text):
        """Users of each all-reduce over tensor of a (B/data * T, D) projection output."""
        names = [
            c.name
            for c in hlo.collectives(text, mesh)
            if c.kind == "all-reduce" and c.axes == ("tensor",) and c.bytes == 128 * 64 * 4
        ]
        return {
            n: [u for u in text.splitlines() if re.search(rf"[(,]\s*%?{re.escape(n.lstrip('%'))}[,)]", u)]
            for n in names
        }

    sp_reduces, tp_reduces = activation_reduces(sp), activation_reduces(tp)
    assert sp_reduces and tp_reduces
    for name, users in sp_reduces.items():
        assert users and all("dynamic-slice" in u for u in users), (name, users)
    # In plain TP those all-reduces keep their whole result: the residual is not split.
    assert not any(all("dynamic-slice" in u for u in users) for users in tp_reduces.values())


def test_errors_name_the_problem(devices, tmp_path):
    from spmd.assembly.config import load_config
    from spmd.assembly.setup import assemble
    from spmd.core.errors import UserError

    # tiny: 4 heads, 2 kv heads, T=64
    with pytest.raises(
        UserError,
        match="ulysses context parallelism over context=4 splits the heads 4 ways and the kv heads 4 ways",
    ):
        assemble("tiny", "data=2,context=4", "cp_ulysses")
    with pytest.raises(UserError, match=r"train.seq_len \(40\) must divide by 16"):
        assemble("tiny", "context=8", "cp_ring", overrides=["train.seq_len=40"])
    with pytest.raises(UserError, match="'attention.context_parallel' .* is a key of the sharding rules now"):
        load_config("tiny", ["attention.context_parallel=rings"])
    with pytest.raises(UserError, match="context_parallel must be one of ring, ulysses, allgather"):
        (tmp_path / "rings.toml").write_text('extends = "cp_ring"\ncontext_parallel = "rings"\n')
        load_rules(str(tmp_path / "rings.toml"))
