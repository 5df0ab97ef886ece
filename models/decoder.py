"""The decoder-only transformer the families here build on: embedding, a stack of layers, final
norm and logits, and the KV cache decoding keeps.

Legend: B batch, T sequence, S cache slots, D embed (d_model), K kv heads, H head dim, V vocab,
L layers, G layer groups.

A family subclasses `Decoder`: `BLOCK` is its layer, built as `BLOCK(cfg, rngs=..., moe=...)` and
called as `block(x_BTD, positions_BT, kv, segment_ids_BT, order_BT) -> (x_BTD, new kv or None,
Aux or None)`; `init_input`/`init_output` make its embedding and its head (in that order: the
parameters are drawn in creation order), `embed` and `head` apply them. Layers are created stacked
(a leading `layers` axis) and run by one `jax.lax.scan`, so compile time does not grow with depth;
when the rules split the layer stack over pipeline stages, by the pipeline instead; when decoding
with one cache array per layer, by a Python loop (each layer's cache written in place).

An MoE model (`cfg.moe`, models/moe.py) with `moe.every = m` runs L/m groups of m-1 dense layers
and one MoE layer: two stacks, `layers` and `moe_layers`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd.core.family import Aux, ModelFamily, Tail
from spmd.core.logical import constrain, is_split, provided
from spmd.models import moe

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmuls without batch axes: the projections (flattened to 2-D by `project`), not the
    # attention scores, which are batched over (B, K) and would cost O(T^2) to keep.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # The same residuals, moved to host memory after the forward and back for the backward
    # (needs a backend that moves data between memories inside a program: spmd/parallel/memory.py).
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}

# The only activations we constrain: the residual stream and the logits. Everything else the
# partitioner infers from the parameters. The residual's sequence axis has its own name, `act_seq`,
# so rules can split it where attention and MLP internals are not (Megatron sequence parallelism).
RESIDUAL_AXES = ("batch", "act_seq", "act_embed")
LOGITS_AXES = ("batch", "seq", "act_vocab")
# Heads before slots: the attention reads a cache as (B*K, S, H) without a transpose (a copy of
# the whole cache per layer and token in XLA:CPU with the slots first).
KV_CACHE_AXES = ("layers", "batch", "act_kv_heads", "seq", "head_dim")


class KVCache(NamedTuple):
    """Keys and values of every layer for S slots, and the position of the token in each slot
    (-1: empty or padding). Decoding writes T new slots at `index`. The keys and values are one
    stacked array each, or a tuple of one (B, K, S, H) array per layer (`empty(per_layer=True)`)."""

    k_LBKSH: jax.Array | tuple[jax.Array, ...]
    v_LBKSH: jax.Array | tuple[jax.Array, ...]
    positions_BS: jax.Array
    index: jax.Array  # scalar int32: the next slot to write

    @classmethod
    def empty(cls, cfg, batch: int, slots: int, per_layer: bool = False) -> "KVCache":
        """per_layer: what XLA:CPU decodes fastest (a layer's slice of a stacked cache is a copy
        there, a layer's own array is updated in place)."""
        layer, dtype = (batch, cfg.n_kv_heads, slots, cfg.head_dim), jnp.dtype(cfg.dtype)
        if per_layer:
            zeros = tuple(jnp.zeros(layer, dtype) for _ in range(cfg.n_layers))
        else:
            zeros = jnp.zeros((cfg.n_layers, *layer), dtype)
        return cls(zeros, zeros, jnp.full((batch, slots), -1, jnp.int32), jnp.zeros((), jnp.int32))

    @classmethod
    def shardings(cls, cfg, per_layer: bool, sharding) -> "KVCache":
        """The cache's structure with `sharding(logical axes)` at each array."""
        kv = (sharding(KV_CACHE_AXES[1:]),) * cfg.n_layers if per_layer else sharding(KV_CACHE_AXES)
        return cls(kv, kv, sharding(("batch", "seq")), sharding(()))

    @staticmethod
    def axes(cfg, per_layer: bool) -> dict:
        return {"kv cache": KV_CACHE_AXES[1:] if per_layer else KV_CACHE_AXES}


def moe_config(cfg):
    """The model's MoE settings (models/moe.py: MoEConfig), or None for a dense model."""
    return getattr(cfg, "moe", None)


def layer_groups(cfg) -> tuple[int, int, bool]:
    """(groups, dense layers per group, whether a group ends in an MoE layer). The layer scan runs
    over groups: a dense model is L groups of one dense layer; an MoE model with moe.every = m is
    L/m groups of m-1 dense layers and one MoE layer."""
    moe = moe_config(cfg)
    if moe is None:
        return cfg.n_layers, 1, False
    return cfg.n_layers // moe.every, moe.every - 1, True


def activations(cfg, batch: int, seq_len: int) -> dict:
    """name -> (logical axes, shape) of each activation the decoder constrains in training."""
    from spmd.models.moe import DISPATCHED_AXES, dispatched_shape

    out = {
        "activation residual_BTD": (RESIDUAL_AXES, (batch, seq_len, cfg.d_model)),
        "activation logits_BTV": (LOGITS_AXES, (batch, seq_len, cfg.vocab_size)),
    }
    if moe_config(cfg) is not None:
        out["moe dispatched_BECD"] = (DISPATCHED_AXES, dispatched_shape(cfg, batch, seq_len))
    return out


def _logical_axes(state, f) -> list[tuple]:
    """Each variable's logical axes (its `out_sharding` metadata) through `f`, in the order of
    jax.tree.leaves(state)."""
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [f(tuple(v.get_metadata().get("out_sharding") or ())) for v in variables]


class Decoder(nnx.Module):
    """The layer stack and its scan, pipeline and cache handling. A subclass defines `BLOCK` and

    - `init_input(cfg, rngs)`: make the embedding's parameters;
    - `init_output(cfg, rngs)`: make the final norm's and the output head's;
    - `embed(tokens_BT, positions_BT)`: (B, T) ids -> the residual stream (B, T, D), compute dtype;
    - `head(x_BTD)`: final norm, then (B, T, D) -> logits (B, T, V).
    """

    BLOCK: type

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.init_input(cfg, rngs)
        groups, dense_per_group, has_moe = layer_groups(cfg)

        def stack(n, moe):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked_blocks(rngs):
                return self.BLOCK(cfg, rngs=rngs, moe=moe)

            return stacked_blocks(rngs)

        if dense_per_group:
            self.layers = stack(groups * dense_per_group, False)
        if has_moe:
            self.moe_layers = stack(groups, True)
        self.init_output(cfg, rngs)

    def __call__(self, tokens_BT, positions_BT=None, cache: KVCache | None = None):
        """Logits for every position; with a cache, also the updated cache (see KVCache)."""
        logits_BTV, cache, _ = self.forward(tokens_BT, positions_BT, cache)
        return logits_BTV if cache is None else (logits_BTV, cache)

    def forward(
        self, tokens_BT, positions_BT=None, cache: KVCache | None = None, segment_ids_BT=None, order_BT=None,
        tail: Tail | None = None,
    ):  # fmt: skip
        """(logits, updated cache or None, Aux stacked over the layers that make it, or None).
        segment_ids_BT, order_BT: packed documents (training); see the families' attention.
        With a `tail` (training under a pipeline that schedules its backward, which runs the head
        and the loss on each microbatch), the tail's (loss, sums) in place of the logits."""
        cfg = self.cfg
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        embed = lambda inputs: constrain(self.embed(*inputs), RESIDUAL_AXES)  # noqa: E731
        groups, dense_per_group, has_moe = layer_groups(cfg)
        per_group = dense_per_group + has_moe

        # Scan inputs, one row per group: the dense layers' state (groups, dense_per_group, ...),
        # the MoE layer's state, and (decoding) the group's index into the caches.
        # stack_axes: each leaf's logical axes, in leaf order (a group's dense rows get a dimension).
        xs, graphdefs, stack_axes = {}, {}, {}
        if dense_per_group:
            graphdefs["dense"], state = nnx.split(self.layers)
            xs["dense"] = jax.tree.map(lambda a: a.reshape(groups, dense_per_group, *a.shape[1:]), state)
            stack_axes["dense"] = _logical_axes(state, lambda axes: (axes[0], None, *axes[1:]))
        if has_moe:
            graphdefs["moe"], xs["moe"] = nnx.split(self.moe_layers)
            stack_axes["moe"] = _logical_axes(xs["moe"], lambda axes: axes)
        kv_LG = None  # the caches as (groups, per_group, B, K, S, H), the scan's carry
        # A cache given as one array per layer (KVCache.empty(per_layer=True)) is kept so: the
        # layers run as a Python loop (a fully unrolled scan), each writing its own array in place.
        per_layer = cache is not None and isinstance(cache.k_LBKSH, tuple)
        if cache is not None:
            positions_BS = jax.lax.dynamic_update_slice_in_dim(
                cache.positions_BS, positions_BT, cache.index, axis=1
            )
            # The caches ride in the scan's carry, each layer's new slots written in place: as the
            # scan's inputs and outputs every token would copy them whole and zero the outputs
            # first.
            kv_LG = (
                (cache.k_LBKSH, cache.v_LBKSH)
                if per_layer
                else tuple(c.reshape(groups, per_group, *c.shape[1:]) for c in (cache.k_LBKSH, cache.v_LBKSH))
            )
            xs["group"] = np.arange(groups) if per_layer else jnp.arange(groups)

        def group(carry, xs, side):
            x_BTD, kv_LG = carry
            positions_BT, segment_ids_BT, order_BT = side
            aux = None
            for i in range(per_group):
                moe = i == dense_per_group
                block = (
                    nnx.merge(graphdefs["moe"], xs["moe"])
                    if moe
                    else nnx.merge(graphdefs["dense"], jax.tree.map(lambda a: a[i], xs["dense"]))
                )
                kv = None
                if per_layer:
                    layer = int(xs["group"]) * per_group + i
                    kv = (kv_LG[0][layer], kv_LG[1][layer], positions_BS, cache.index)
                elif kv_LG is not None:
                    start = (xs["group"], i, 0, 0, 0, 0)
                    k_BKSH, v_BKSH = (
                        jax.lax.dynamic_slice(c, start, (1, 1, *c.shape[2:]))[0, 0] for c in kv_LG
                    )
                    kv = (k_BKSH, v_BKSH, positions_BS, cache.index)
                x_BTD, layer_kv, layer_aux = block(x_BTD, positions_BT, kv, segment_ids_BT, order_BT)
                x_BTD = constrain(x_BTD, RESIDUAL_AXES)
                aux = layer_aux if moe else aux
                if per_layer:
                    kv_LG = tuple(
                        c[:layer] + (new,) + c[layer + 1 :] for c, new in zip(kv_LG, layer_kv, strict=True)
                    )
                elif kv_LG is not None:
                    # Only the T new slots go back into the carry.
                    T, at = x_BTD.shape[1], (xs["group"], i, 0, 0, cache.index, 0)
                    kv_LG = tuple(
                        jax.lax.dynamic_update_slice(
                            c, jax.lax.dynamic_slice_in_dim(new, cache.index, T, axis=2)[None, None], at
                        )
                        for c, new in zip(kv_LG, layer_kv, strict=True)
                    )
            return (x_BTD, kv_LG), aux

        if cfg.remat != "none" and cache is None:
            group = jax.checkpoint(group, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)

        def run_groups(x_BTD, kv_LG, xs, side):
            """The groups stacked in `xs` applied in order: ((x, caches), aux stacked)."""
            n = jax.tree.leaves(xs)[0].shape[0]
            if per_layer:
                carry, aux = (x_BTD, kv_LG), []
                for g in range(n):
                    carry, group_aux = group(carry, jax.tree.map(lambda a: a[g], xs), side)
                    aux.append(group_aux)
                return carry, None if aux[0] is None else jax.tree.map(lambda *s: jnp.stack(s), *aux)
            return jax.lax.scan(
                lambda carry, row: group(carry, row, side), (x_BTD, kv_LG), xs, unroll=min(cfg.scan_unroll, n)
            )

        def stage_groups(x_BTD, xs, side):
            (x_BTD, _), aux = run_groups(x_BTD, None, xs, side)
            return x_BTD, aux

        side = (positions_BT, segment_ids_BT, order_BT)
        piped = cache is None and is_split("layers")
        if tail is not None and not piped:
            raise ValueError("a Tail is run by a pipeline's schedule; without one, apply it to the logits")
        if piped:
            # The layer stack is split over pipeline stages (spmd/parallel/pipeline.py); with a
            # tail, the pipeline runs the head and the loss too.
            pipe = dict(
                x_axes=RESIDUAL_AXES,
                xs_axes=[axes for key in sorted(xs) for axes in stack_axes[key]],
                combine_stats=Aux.of_microbatches,
            )
            if tail is not None:
                head = lambda x_BTD: constrain(self.head(x_BTD), LOGITS_AXES)  # noqa: E731
                loss_and_sums, aux = provided("pipeline_loss")(
                    stage_groups, embed, (tokens_BT, positions_BT), xs, side, head=head, tail=tail, **pipe
                )
                return loss_and_sums, None, aux
            x_BTD, aux = provided("pipeline")(
                stage_groups, embed((tokens_BT, positions_BT)), xs, side, **pipe
            )
        else:
            (x_BTD, kv_LG), aux = run_groups(embed((tokens_BT, positions_BT)), kv_LG, xs, side)
        if per_layer:
            k_LBKSH, v_LBKSH = (tuple(constrain(c, KV_CACHE_AXES[1:]) for c in cs) for cs in kv_LG)
            cache = KVCache(k_LBKSH, v_LBKSH, positions_BS, cache.index + tokens_BT.shape[1])
        elif cache is not None:
            k_LBKSH, v_LBKSH = (c.reshape(cfg.n_layers, *c.shape[2:]) for c in kv_LG)
            cache = KVCache(
                constrain(k_LBKSH, KV_CACHE_AXES),
                constrain(v_LBKSH, KV_CACHE_AXES),
                positions_BS,
                cache.index + tokens_BT.shape[1],
            )
        return constrain(self.head(x_BTD), LOGITS_AXES), cache, aux


def attention_flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs of the attention scores and their use, per token: QK^T and PV, 2 matmuls x
    2 FLOPs x T x N*H forward, x3 for forward and backward, halved by the causal mask."""
    return 3 * 2 * 2 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers / 2


def family(name: str, config_cls, model_cls, figures, *, hf=None, adapter_targets=None, logical_axes=None,
           mixture: bool = False) -> ModelFamily:  # fmt: skip
    """The ModelFamily (spmd.core.family) of a model built on `Decoder`: its activations and KV
    cache are this module's; with `mixture`, its auxiliary losses and metrics are the MoE layer's
    (a config with a `[moe]` table)."""
    return ModelFamily(
        name=name,
        config_cls=config_cls,
        model_cls=model_cls,
        figures=figures,
        activations=activations,
        cache_axes=KVCache.axes,
        empty_cache=KVCache.empty,
        cache_shardings=KVCache.shardings,
        logical_axes=logical_axes or {},
        **({"aux_weights": moe.aux_weights, "aux_metrics": moe.aux_metrics} if mixture else {}),
        hf=hf,
        adapter_targets=adapter_targets or {},
    )
