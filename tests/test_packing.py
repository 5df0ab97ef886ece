"""Packed documents (data.packing = segments): a packed batch computes exactly what its documents
compute run one by one (summed loss and gradients), with every attention implementation and every
context-parallel mode; the packed windows mark documents correctly and are a pure function of the
index."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.assembly.config import apply_overrides
from spmd.assembly.setup import assemble
from spmd.core.rules import load_rules
from spmd.data.loader import PACKED_FIELDS, PackedWindowSource
from spmd.parallel import context
from spmd.training.trainer import token_losses

T = 32
# Two packed rows of T + 1 tokens (inputs and shifted targets): 3 + 2 documents, cut exactly at
# the window edges, so the documents run separately are whole.
ROWS = [[11, 11, 11], [22, 11]]


class Stream:
    """A TokenStream stand-in: tokens in memory, document ends."""

    def __init__(self, docs):
        self.tokens = np.concatenate(docs)
        self.doc_ends = np.cumsum([len(d) for d in docs])

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index]

    def mask(self, index):  # text: every token is trained on
        return None


def test_packed_windows_mark_documents():
    docs = [np.arange(100, 105), np.arange(200, 203), np.arange(300, 312)]  # 5 + 3 + 12 tokens
    source = PackedWindowSource(Stream(docs), seq_len=6)
    assert len(source) == (20 - 1) // 6
    w0, w1 = source[0], source[1]
    assert w0.shape == (len(PACKED_FIELDS), 6)
    fields = dict(zip(PACKED_FIELDS, w0))
    np.testing.assert_array_equal(fields["inputs"], [100, 101, 102, 103, 104, 200])
    np.testing.assert_array_equal(fields["targets"], [101, 102, 103, 104, 200, 201])
    np.testing.assert_array_equal(fields["segment_ids"], [0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(fields["positions"], [0, 1, 2, 3, 4, 0])
    # Token 104 -> 200 would predict document 2's first token from document 1: not counted.
    np.testing.assert_array_equal(fields["loss_mask"], [1, 1, 1, 1, 0, 1])
    fields = dict(zip(PACKED_FIELDS, w1))  # tokens 6..12: 201 202 | 300 301 302 303 (304)
    np.testing.assert_array_equal(fields["inputs"], [201, 202, 300, 301, 302, 303])
    np.testing.assert_array_equal(fields["segment_ids"], [0, 0, 1, 1, 1, 1])
    # Document 2's tail starts this window as a segment of its own: it cannot see its head, so
    # its positions start at 0 like any segment's.
    np.testing.assert_array_equal(fields["positions"], [0, 1, 0, 1, 2, 3])
    np.testing.assert_array_equal(fields["loss_mask"], [1, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(source[1], w1)  # a pure function of the index


def _docs(rng):
    return [[rng.integers(0, 256, n).astype(np.int32) for n in row] for row in ROWS]


def _packed_batch(docs):
    rows = [PackedWindowSource(Stream(row), T)[0] for row in docs]
    return {name: np.stack([r[k] for r in rows]) for k, name in enumerate(PACKED_FIELDS)}


def _loss_and_grads(setup, params, batch):
    plan = setup.trainer.plan
    perm = context.seq_permutation(plan.rules, plan.mesh, batch["inputs"].shape[1])

    def f(params, batch):
        with plan.activate():
            loss, (_, _, count, _) = token_losses(
                plan.graphdef, params, batch, z_loss=0.0, mask_token_id=-1, seq_perm=perm
            )
        return loss, count

    (loss, count), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, batch)
    return float(loss), float(count), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def separate(devices, tiny_cfg):
    """Every document as its own sequence on one device: summed loss, count, gradients, params."""
    docs = _docs(np.random.default_rng(0))
    cfg = apply_overrides(
        tiny_cfg, [f"train.seq_len={T}", "train.global_batch_size=2", "data.packing=segments"]
    )
    plain = assemble(apply_overrides(cfg, ["data.packing=concat"]), "fsdp=1", "fsdp", devices=devices[:1])
    params = jax.tree.map(np.asarray, plain.trainer.init_state()["params"])
    total, count, grads = 0.0, 0.0, None
    by_length = {}
    for doc in (d for row in docs for d in row):
        by_length.setdefault(len(doc), []).append(doc)
    for same in by_length.values():  # documents of one length in one batch: the sums add up alike
        batch = {"inputs": np.stack([d[:-1] for d in same]), "targets": np.stack([d[1:] for d in same])}
        loss, n, g = _loss_and_grads(plain, params, batch)
        total, count = total + loss, count + n
        grads = g if grads is None else jax.tree.map(np.add, grads, g)
    return {"cfg": cfg, "docs": docs, "params": params, "loss": total, "count": count, "grads": grads}


def _check(separate, mesh, rules, overrides, devices):
    cfg = apply_overrides(separate["cfg"], overrides)
    setup = assemble(cfg, mesh, rules, devices=devices)
    loss, count, grads = _loss_and_grads(setup, separate["params"], _packed_batch(separate["docs"]))
    assert count == separate["count"] == sum(n - 1 for row in ROWS for n in row)
    np.testing.assert_allclose(loss, separate["loss"], rtol=1e-5)
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(separate["grads"])):
        err = np.abs(g - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas"])
def test_packed_batch_equals_its_documents_one_by_one(separate, devices, impl):
    _check(separate, "fsdp=1", "fsdp", [f"model.attention_impl={impl}"], devices[:1])


@pytest.mark.parametrize(
    "rules,mesh,layout",
    [
        ("cp_ring", "data=2,context=4", "zigzag"),
        ("cp_ring", "data=2,context=4", "striped"),
        ("cp_ring", "data=2,context=4", "zigzag:pallas"),  # ring blocks by the flash kernel
        ("allgather", "data=2,context=4", ""),
        ("cp_ulysses", "data=2,context=2", ""),
    ],
)
def test_packed_batch_under_context_parallelism_equals_its_documents(separate, devices, rules, mesh, layout):
    n = int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))
    layout, _, impl = layout.partition(":")
    overrides = [f"model.attention_impl={impl}"] if impl else []
    if layout:  # the rules' context-parallel key
        rules = dataclasses.replace(load_rules(rules), load_balance=layout)
    _check(separate, mesh, rules, overrides, devices[:n])


def test_packing_segments_needs_document_boundaries(tiny_cfg):
    from spmd.core.errors import UserError
    from spmd.data.loader import make_batches

    with pytest.raises(UserError, match="data.packing = segments needs to know where documents end"):
        make_batches(apply_overrides(tiny_cfg, ["data.packing=segments"]), None)


def test_token_losses_count_only_masked_in_targets(separate):
    """The loss mask is honoured: zeroing it leaves nothing counted."""
    batch = _packed_batch(separate["docs"])
    batch["loss_mask"] = jnp.zeros_like(batch["loss_mask"])
    plain = assemble(separate["cfg"], "fsdp=1", "fsdp", devices=jax.devices()[:1])
    _, count, _ = _loss_and_grads(plain, separate["params"], batch)
    assert count == 0
