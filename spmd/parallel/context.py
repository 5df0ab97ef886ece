"""Context parallelism: attention over a sequence sharded across the mesh axes of `seq`.

Three ways to let every query see keys held by other devices (`Rules.context_parallel`):

- ring: K/V blocks rotate around the ring with ppermute (kernels/ring_attention.py), each block
  computed by the Pallas flash kernel (attention_impl pallas, the default on GPU) or blockwise in
  plain JAX (CPU); memory per device O(T/n); with `load_balance = zigzag|striped` the sequence is permuted once per batch so
  causal work is even across devices.
- ulysses: all-to-all from sequence-sharded to head-sharded, ordinary attention over the whole
  sequence for 1/n of the heads, all-to-all back. Needs heads and kv heads divisible by n.
- allgather: gather K/V over the axis, attend the local queries to all of it. The simple baseline:
  memory O(T) per device for K/V.

Everything outside attention is position-wise, so GSPMD partitions it along the sequence by itself.
"""

import functools

import jax
import numpy as np

from spmd.core.logical import KV_AXES, Q_AXES, TOKEN_AXES, lowering, split_axes, split_size
from spmd.core.logical import active as active_sharding
from spmd.core.mesh import axes_size, format_axes
from spmd.core.rules import CONTEXT_PARALLEL
from spmd.kernels import ring_attention as ring
from spmd.kernels.chunked_attention import traced_zero
from spmd.parallel.strategy import Attribution, Strategy, names_on, rule


def seq_axes(rules, mesh) -> tuple[tuple[str, ...], int]:
    """Mesh axes of the `seq` logical axis that have more than one device, and their product."""
    return split_axes(rules, mesh, "seq"), split_size(rules, mesh, "seq")


def active():
    """(rules, mesh, axes, n) when the active rules shard the sequence, else None."""
    current = active_sharding()
    if current is None:
        return None
    rules, mesh = current
    axes, n = seq_axes(rules, mesh)
    return (rules, mesh, axes, n) if n > 1 else None


def layout(rules) -> str:
    """The sequence layout a mode trains with; Ulysses attends the whole sequence per head, so it
    has no imbalance to fix and keeps the natural order."""
    return "contiguous" if rules.context_parallel == "ulysses" else rules.load_balance


def seq_permutation(rules, mesh, seq_len: int) -> np.ndarray | None:
    """The permutation applied to each batch's sequence under these rules, or None."""
    axes, n = seq_axes(rules, mesh)
    if n == 1 or layout(rules) == "contiguous":
        return None
    return ring.layout_permutation(seq_len, n, layout(rules))


def check(rules, mesh, n_heads: int, n_kv_heads: int, seq_len: int) -> list[str]:
    """Problems with running these rules' context parallelism on this mesh and model."""
    axes, n = seq_axes(rules, mesh)
    if n == 1:
        return []
    sizes = mesh.shape
    problems = []
    where = format_axes(sizes, axes)
    lay = layout(rules)
    pieces = n * (2 if lay == "zigzag" else 1)
    if seq_len % pieces:
        problems.append(
            f"train.seq_len ({seq_len}) must divide by {pieces} for {rules.context_parallel} context "
            f"parallelism over {where} with load_balance={lay}"
        )
    if rules.context_parallel == "ulysses":
        head_split = n * axes_size(sizes, rules.mapping.get("act_heads", ()))
        kv_split = n * axes_size(sizes, rules.mapping.get("act_kv_heads", ()))
        if n_heads % head_split or n_kv_heads % kv_split:
            problems.append(
                f"ulysses context parallelism over {where} splits the heads {head_split} ways and the kv heads "
                f"{kv_split} ways, but the model has n_heads={n_heads}, n_kv_heads={n_kv_heads}; "
                f"use context_parallel=ring or a smaller context axis"
            )
    return problems


def context_attention(
    q_BTNH, k_BSKH, v_BSKH, positions_BT, segment_ids_BT=None, *, causal=True, local_impl=None, kernel=None
):
    """Attention with the sequence sharded over the active rules' `seq` axes (see module doc).

    `local_impl(q, k, v, causal=)` is the single-device attention Ulysses runs on whole sequences
    in natural order (xla, chunked or the Pallas kernel). `kernel`: the ring computes its blocks
    with the Pallas flash kernel (zigzag and contiguous layouts; striped falls back to the
    pure-JAX blocks, whose masks come from positions); "pallas_tpu" is its TPU block layout."""
    rules, mesh, axes, n = active()
    axis_name = axes if len(axes) > 1 else axes[0]
    mode = rules.context_parallel
    spec = rules.spec
    has_seg = segment_ids_BT is not None
    positions_BT = positions_BT + traced_zero(q_BTNH)  # keeps masks out of the layer scan's residuals
    args = (q_BTNH, k_BSKH, v_BSKH, positions_BT) + ((segment_ids_BT,) if has_seg else ())
    in_specs = (spec(Q_AXES), spec(KV_AXES), spec(KV_AXES), spec(TOKEN_AXES)) + (
        (spec(TOKEN_AXES),) if has_seg else ()
    )

    if mode == "ring":
        blocks = ring.ring_flash_attention if kernel and layout(rules) != "striped" else ring.ring_attention

        def local(q, k, v, pos, seg=None):
            return blocks(
                q,
                k,
                v,
                pos,
                seg,
                axis_name=axis_name,
                axis_size=n,
                causal=causal,
                sub_chunks=ring.sub_chunks(layout(rules)),
                **(
                    {"tpu": kernel == "pallas_tpu", "interpret": lowering().interpret}
                    if blocks is ring.ring_flash_attention
                    else {}
                ),
            )
    elif mode == "allgather":

        def local(q, k, v, pos, seg=None):
            gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
            return ring.masked_attention(
                q,
                gather(k),
                gather(v),
                pos,
                gather(pos),
                seg,
                None if seg is None else gather(seg),
                causal=causal,
            )
    elif mode == "ulysses":

        def local(q, k, v, pos, seg=None):
            # Sequence-sharded -> head-sharded: split heads n ways, gather the sequence.
            to_heads = functools.partial(
                jax.lax.all_to_all, axis_name=axis_name, split_axis=2, concat_axis=1, tiled=True
            )
            q, k, v = to_heads(q), to_heads(k), to_heads(v)
            if seg is None and local_impl is not None:
                out = local_impl(q, k, v, causal=causal)
            else:
                gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
                pos = gather(pos)
                seg = None if seg is None else gather(seg)
                out = ring.masked_attention(q, k, v, pos, pos, seg, seg, causal=causal)
            return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)
    else:
        raise ValueError(
            f"unknown context_parallel mode {mode!r}; choose one of {', '.join(CONTEXT_PARALLEL)}"
        )

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec(Q_AXES), check_vma=False)(*args)


# --- the strategy ---------------------------------------------------------------------------------


def minimum(step) -> float:
    """Per layer, what moves the keys and values of the local piece (heads split over tensor where
    the rules say so), by mode."""
    n = step.n_ctx
    if n <= 1:
        return 0.0
    fig, rules, B, T, itemsize = step.fig, step.plan.rules, step.B, step.T, step.itemsize
    t_heads = step.sizes.get("tensor", 1) if "tensor" in rules.mapping.get("kv_heads", ()) else 1
    kv = 2 * B * T * (fig.n_kv_heads // t_heads) * fig.head_dim * itemsize
    mode = rules.context_parallel
    if mode == "ring":
        # Forward: K/V pass n-1 hops. Backward (kernels/ring_attention.py): K/V again n-1 hops, and
        # their fp32 dK/dV accumulators n hops back home. The keys' int32 positions travel with
        # them, both ways.
        per_layer = 2 * (n - 1) * (kv + B * T * 4) + n * kv * 4 / itemsize
    elif mode == "ulysses":
        # q, k, v to head-sharded and o back, forward; their gradients, backward.
        qo = 2 * B * T * (fig.n_heads // t_heads) * fig.head_dim * itemsize
        per_layer = 2 * (qo + kv) * (n - 1) / n
    else:  # allgather: gather K/V (and positions) forward, reduce-scatter their gradients backward
        per_layer = 2 * (n - 1) * kv + (n - 1) * B * T * 4
    return step.n_layers * per_layer


def ring_passes(c, seen):
    """Keys and values passed around the ring (ring attention's collective-permutes)."""
    names = names_on(seen.rules, seen.axes, ("seq",))
    if "ppermute" in c.op_name and "shard_map" in c.op_name and names:
        return rule(names, seen.axes), "keys and values passed around the ring"
    return None


STRATEGY = Strategy(
    name="context",
    rank=50,
    axes=("context",),
    ops={"context_attention": context_attention},
    check=lambda rules, mesh, figures, seq_len: check(
        rules, mesh, figures.n_heads, figures.n_kv_heads, seq_len
    ),
    minimum=minimum,
    attributions=(Attribution(220, "collective", ring_passes),),
)
