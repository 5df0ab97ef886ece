"""Train state, the jitted train and eval steps, and the Trainer that ties them to a mesh.

The train state is a plain pytree `{"params", "opt_state", "step"}` whose shardings come from the
rules. The step takes and returns it with those shardings and donates the old one. When a model
transform freezes part of the model (spmd.training.transform), `params` holds what trains and
`frozen` the rest, passed through.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd.core.errors import UserError
from spmd.core.family import Tail
from spmd.parallel import context, dataparallel, memory
from spmd.parallel import sharding as sharding_lib
from spmd.parallel import slices as slices_lib
from spmd.platform import cpu_matmul, distributed
from spmd.training import preference, sliced, transform
from spmd.training.loss import cross_entropy, target_logits
from spmd.training.optimizer import decay_mask, lr_schedule, make_optimizer, matrix_dims

# Parts of a train state that checkpoints do not hold: the frozen parameters and the reference
# model of a preference objective are both the weights the run started from.
NOT_SAVED = ("frozen", "reference")
Batch = dict[str, jax.Array]  # {"inputs": (B, T) int32, "targets": (B, T) int32, ...} (batch_keys)


def batch_keys(cfg) -> tuple[str, ...]:
    """The (B, T) int32 arrays of a batch: inputs and targets, and with packed documents each
    token's segment id, position in its document, and whether its target counts."""
    from spmd.data.loader import PACKED_FIELDS

    if cfg.train.objective != "lm":  # pairs of sequences (spmd.training.preference)
        return preference.batch_fields(cfg)
    return PACKED_FIELDS if cfg.data.packing == "segments" else ("inputs", "targets")


def batch_shardings(cfg, plan) -> dict:
    """The sharding of each array of a batch: rows over the batch axes, tokens as the rules say;
    a per-row vector (precomputed reference log-probabilities) over the batch axes alone."""
    rows = NamedSharding(plan.mesh, PartitionSpec(plan.batch_sharding.spec[0]))
    return {k: rows if k == preference.REFERENCE_FIELD else plan.batch_sharding for k in batch_keys(cfg)}


def token_losses(
    graphdef, params, batch: Batch, *, z_loss: float, mask_token_id: int, seq_perm=None, aux_weights=None,
    fused_loss: bool = False, in_schedule: bool = False,
):  # fmt: skip
    """Sums over the batch's counted tokens: (total loss, (cross-entropy, z-loss, count, aux sums)).

    `seq_perm` (context parallelism's load balance) reorders every sequence before the model; the
    model gets each token's true position, and the sums do not depend on the order.
    `aux_weights`: the weight of each of the model's auxiliary losses (spmd.core.family.Aux) in the
    total; the aux sums hold each loss's mean times the count, and the model's statistics.
    `fused_loss`: the cross-entropy of spmd.training.loss (no float32 copy of the logits; the platform
    policy's choice), else optax's on float32 logits. `in_schedule`: the model runs the loss (its
    Tail) itself, as a pipeline that schedules its backward does on each microbatch."""
    inputs_BT, targets_BT, positions_BT, order_BT = batch["inputs"], batch["targets"], None, None
    # Packed documents (data.packing = segments): each token's document, its position in it (for
    # RoPE), and which targets count (not the first token of a document, predicted from the one
    # before).
    segment_ids_BT, loss_mask_BT = batch.get("segment_ids"), batch.get("loss_mask")
    if segment_ids_BT is not None:
        positions_BT = batch["positions"]
    if seq_perm is not None:
        inputs_BT, targets_BT = inputs_BT[:, seq_perm], targets_BT[:, seq_perm]
        # Each token's index in the sequence: the positions of an unpacked sequence, and what
        # context parallelism's masks compare for a packed one.
        order_BT = jnp.broadcast_to(jnp.asarray(seq_perm, jnp.int32), inputs_BT.shape)
        if segment_ids_BT is None:
            positions_BT, order_BT = order_BT, None
        else:
            positions_BT, segment_ids_BT = positions_BT[:, seq_perm], segment_ids_BT[:, seq_perm]
            loss_mask_BT = loss_mask_BT[:, seq_perm]
    mask_BT = (targets_BT != mask_token_id) if mask_token_id >= 0 else jnp.ones_like(targets_BT, dtype=bool)
    if loss_mask_BT is not None:
        mask_BT = mask_BT & (loss_mask_BT != 0)
    mask_BT = mask_BT.astype(jnp.float32)
    count = jnp.sum(mask_BT)

    def aux_loss(aux):
        # Auxiliary losses are means over the layers that make them; weighted by the token count
        # like the other sums, so dividing by the count (after accumulation) leaves weight x mean.
        weighted = None
        for name, weight in (aux_weights or {}).items() if aux is not None else ():
            term = weight * jnp.mean(aux.losses[name])
            weighted = term if weighted is None else weighted + term
        return 0.0 if weighted is None else weighted * count

    tail = Tail(
        functools.partial(row_losses, z_loss=z_loss, fused_loss=fused_loss),
        {"targets": targets_BT, "mask": mask_BT},
        aux_loss,
    )
    model = nnx.merge(graphdef, params)
    if in_schedule:
        (total, (ce_sum, z_sum)), _, aux = model.forward(
            inputs_BT, positions_BT, segment_ids_BT=segment_ids_BT, order_BT=order_BT, tail=tail
        )
    else:
        logits_BTV, _, aux = model.forward(
            inputs_BT, positions_BT, segment_ids_BT=segment_ids_BT, order_BT=order_BT
        )
        loss, (ce_sum, z_sum) = tail.fn(logits_BTV, tail.rows)
        total = loss + tail.aux_loss(aux)
    if aux is None:
        return total, (ce_sum, z_sum, count, {})
    means = {name: jnp.mean(v) for name, v in aux.losses.items()}
    sums = {**{name: m * count for name, m in means.items()}, **aux.sums}
    return total, (ce_sum, z_sum, count, sums)


def row_losses(logits_BTV, rows, *, z_loss: float, fused_loss: bool):
    """(cross-entropy + z-loss, (cross-entropy, z-loss)) summed over the counted tokens of some rows
    (`rows`: targets, and the float mask of the tokens that count)."""
    targets_BT, mask_BT = rows["targets"], rows["mask"]
    ce_BT, lse_BT = cross_entropies(logits_BTV, targets_BT, fused_loss)
    ce_sum = jnp.sum(ce_BT * mask_BT)
    z_sum = jnp.zeros((), jnp.float32)
    if z_loss:
        lse_BT = jax.nn.logsumexp(logits_BTV.astype(jnp.float32), axis=-1) if lse_BT is None else lse_BT
        z_sum = z_loss * jnp.sum(jnp.square(lse_BT) * mask_BT)
    return ce_sum + z_sum, (ce_sum, z_sum)


def cross_entropies(logits_BTV, targets_BT, fused_loss: bool):
    """(cross-entropy (B, T) float32, its logsumexp or None); `fused_loss`: see token_losses."""
    if fused_loss:
        return cross_entropy(logits_BTV, targets_BT)
    # optax.softmax_cross_entropy_with_integer_labels's arithmetic, its target logit a masked sum
    # (loss.target_logits); a negative target counts from the end, as its gather's does.
    logits_BTV = logits_BTV.astype(jnp.float32)
    V = logits_BTV.shape[-1]
    target_BT = target_logits(logits_BTV, jnp.where(targets_BT < 0, targets_BT + V, targets_BT))
    return jax.nn.logsumexp(logits_BTV, axis=-1) - target_BT, None


def forward_ce(graphdef, params, inputs_BT, targets_BT, positions_BT, segment_ids_BT, order_BT, fused_loss):
    """(cross-entropy (B, T) float32, its logsumexp or None, the logits, the model's aux) of one
    forward pass; `fused_loss`: see token_losses."""
    logits_BTV, _, aux = nnx.merge(graphdef, params).forward(
        inputs_BT, positions_BT, segment_ids_BT=segment_ids_BT, order_BT=order_BT
    )
    ce_BT, lse_BT = cross_entropies(logits_BTV, targets_BT, fused_loss)
    return ce_BT, lse_BT, logits_BTV, aux


def preference_losses(
    graphdef, params, batch: Batch, *, objective: str, settings, reference=None, seq_perm=None,
    aux_weights=None, fused_loss: bool = False,
):  # fmt: skip
    """token_losses for a preference objective (spmd.training.preference): (summed loss over the
    batch's pairs, (that sum, 0, pairs, {metric sums, the model's aux sums, "tokens": completion
    tokens})). `reference`: the reference model's parameters (same tree as `params`) for
    objectives that score against one; its forward pass is not differentiated."""
    fields = {k: batch[k] for k in preference.FIELDS}
    positions_BT = order_BT = None
    ref_logps = batch.get(preference.REFERENCE_FIELD)  # precomputed, one per row
    if seq_perm is not None:
        fields = {k: v[:, seq_perm] for k, v in fields.items()}
        positions_BT = jnp.broadcast_to(jnp.asarray(seq_perm, jnp.int32), fields["inputs"].shape)

    def rows(p):
        ce_BT, _, _, aux = forward_ce(graphdef, p, fields["inputs"], fields["targets"], positions_BT, None,
                                      order_BT, fused_loss)  # fmt: skip
        return preference.row_sums(ce_BT, fields["loss_mask"], fields["target_mask"]), aux

    policy, aux = rows(params)
    if reference is not None:
        ref_logps = jax.lax.stop_gradient(rows(jax.lax.stop_gradient(reference))[0][0])
    total, pairs, sums = preference.pair_sums(objective, settings, policy, ref_logps)
    sums["tokens"] = jnp.sum(policy[1])
    if aux is not None:
        means = {name: jnp.mean(v) for name, v in aux.losses.items()}
        for name, weight in (aux_weights or {}).items():
            total = total + weight * means[name] * pairs
        sums.update({name: m * pairs for name, m in means.items()})
        sums.update(aux.sums)
    return total, (total, jnp.zeros((), jnp.float32), pairs, sums)


class _DivergingStep:
    """A jitted step whose devices run different collectives at once (a pipeline whose stages
    diverge), refused when first run where they cannot (spmd.platform.distributed.
    collectives_may_diverge); compiling it (`lower`, a dry-run) needs nothing."""

    def __init__(self, step, devices, schedule: str):
        self.step, self.devices, self.schedule, self.checked = step, devices, schedule, False

    def __call__(self, *args, **kwargs):
        if not self.checked:
            if not distributed.collectives_may_diverge(self.devices):
                raise UserError(
                    f"pipeline.schedule={self.schedule} runs different collectives on different stages at "
                    f"once, which XLA:CPU's in-process collectives cannot: train with spmd-train (it starts "
                    f"JAX's runtime, and with it gloo collectives), or call jax.distributed.initialize("
                    f"'127.0.0.1:PORT', num_processes=1, process_id=0) before JAX starts; "
                    f"pipeline.schedule=gpipe or circular with pipeline.backward=auto or autodiff run without it"
                )
            self.checked = True
        return self.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.step, name)


@dataclasses.dataclass
class Trainer:
    """Everything needed to run jitted steps of one config on one mesh."""

    cfg: object  # spmd.assembly.config.Config
    plan: sharding_lib.ShardingPlan
    tx: optax.GradientTransformation
    state_shardings: dict
    update_shardings: dict  # where gradients are reduced to and the update runs (params' shape)
    train_step: object  # jitted (state, batch) -> (state, metrics)
    eval_step: object  # jitted (params, batch) -> (ce_sum, count)
    init_state: object  # jitted () -> state
    state_from_params: (
        object  # jitted weights (abstract_weights) -> state with fresh optimizer state at step 0
    )
    # The mesh axes a pure data-parallel step sums its gradients over as one flat vector
    # (spmd/parallel/dataparallel.py); None when XLA's all-reduce does it.
    flat_grad_axes: tuple[str, ...] | None = None
    # () -> jitted (state, batch, max_loss) -> (state, metrics): train_step that also leaves the
    # state unchanged when the loss is above max_loss (spikes.action = skip, spmd.loop.spikes); made
    # only by runs that use it (a oneDNN program is kept alive once made: spmd.platform.cpu_matmul.keep)
    guarded_step: object = None
    # which parameters train (`params`) and which are frozen (`frozen`): spmd.training.transform
    partition: transform.Partition = transform.Partition()

    def model_params(self, state) -> dict:
        """The whole model's parameters in a train state: `params`, with the `frozen` ones beside."""
        return transform.combine(state["params"], state["frozen"]) if "frozen" in state else state["params"]

    def reference_params(self, state) -> dict | None:
        """The reference model's parameters (a tree like `model_params`) for an objective that
        scores against one (spmd.training.preference), else None: the state's `reference` copy,
        or under a transform the frozen base with the transform off (no copy)."""
        return reference_params(self.cfg, self.partition, state)

    @property
    def unsaved(self) -> tuple[str, ...]:
        """The parts of the state checkpoints do not hold: they are the weights the run started
        from (spmd.io.checkpoint.unsaved_of restores them)."""
        return tuple(k for k in NOT_SAVED if k in self.state_shardings)

    def to_canonical(self, state):
        """The train state as checkpoints hold it: its layer stacks in canonical order (new arrays
        under a circular pipeline's permuted storage, the arrays themselves otherwise), without the
        frozen parameters and the reference model (`unsaved`)."""
        saved = {k: v for k, v in state.items() if k not in NOT_SAVED}
        return self.plan.to_canonical(saved, {k: self.state_shardings[k] for k in saved})

    def from_canonical(self, state, unsaved: dict | None = None):
        """The inverse of `to_canonical` (after a restore), with the `unsaved` parts put back."""
        state = self.plan.from_canonical(state, {k: self.state_shardings[k] for k in state})
        return {**state, **(unsaved or {})}

    @functools.cached_property
    def abstract_saved(self):
        """`abstract_state` as checkpoints hold it (without the `unsaved` parts): a restore target."""
        return {k: v for k, v in self.abstract_state.items() if k not in NOT_SAVED}

    @functools.cached_property
    def abstract_weights(self):
        """The weights a run starts from (`--init-from`): the model's parameters without those its
        transforms add, in the parameter dtype."""
        return self.partition.without_added(self.plan.abstract_params)

    def fresh_weights(self, seed: int):
        """`abstract_weights` drawn from `seed`, as a fresh run draws them, in canonical layer
        order (as a checkpoint holds them)."""
        shardings = jax.tree.map(lambda x: x.sharding, self.abstract_weights)
        init = self.plan.canonical_init_params
        return jax.jit(lambda: self.partition.without_added(init(seed)), out_shardings=shardings)()

    def frozen_from(self, weights):
        """The state's `frozen` part (in stored layer order) from the weights the run started from
        (`abstract_weights`, canonical order)."""
        frozen = self.partition.split(weights)[1]
        want = self.abstract_state["frozen"]
        frozen = jax.tree.map(lambda x, w: x if x.dtype == w.dtype else x.astype(w.dtype), frozen, want)
        return self.plan.from_canonical(frozen, self.state_shardings["frozen"])

    def unsaved_from(self, weights) -> dict:
        """The state's `unsaved` parts from the weights the run started from (canonical order, as
        a checkpoint restores them)."""
        out = {}
        if "frozen" in self.state_shardings:
            out["frozen"] = self.frozen_from(weights)
        if "reference" in self.state_shardings:
            out["reference"] = self.plan.from_canonical(weights, self.state_shardings["reference"])
        return out

    @functools.cached_property
    def abstract_state(self):
        """The state as ShapeDtypeStructs carrying its shardings: a restore target, a compile input."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(self.init_state),
            self.state_shardings,
        )

    def state_bytes(self) -> dict:
        """Per device (the most loaded one): parameters (trained and frozen), gradients (as the
        update consumes them: split like the update under a sharded weight update), the optimizer
        state in all, and the optimizer state by "dtype memory-kind" (e.g. "bfloat16 pinned_host")."""
        opt = self.abstract_state["opt_state"]
        by = {}
        for x in jax.tree.leaves(opt):
            key = f"{jnp.dtype(x.dtype).name} {x.sharding.memory_kind or 'device'}"
            by[key] = by.get(key, 0) + sharding_lib.tree_bytes_per_device(x)
        trained = self.abstract_state["params"]
        grads = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), trained, self.update_shardings
        )
        frozen = sharding_lib.tree_bytes_per_device(self.abstract_state.get("frozen", {}))
        reference = sharding_lib.tree_bytes_per_device(self.abstract_state.get("reference", {}))
        return {
            "params": sharding_lib.tree_bytes_per_device(trained) + frozen + reference,
            "frozen_params": frozen,
            "reference_params": reference,
            "gradients": sharding_lib.tree_bytes_per_device(grads),
            "optimizer_state": sum(by.values()),
            "optimizer_state_on_host": sum(v for k, v in by.items() if k.endswith(memory.HOST)),
            "optimizer_state_by_kind": dict(sorted(by.items())),
        }

    def abstract_batch(self, batch: int, seq_len: int) -> Batch:
        shardings = batch_shardings(self.cfg, self.plan)
        return {
            name: jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=shardings[name])
            if name == preference.REFERENCE_FIELD
            else jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=shardings[name])
            for name in batch_keys(self.cfg)
        }


def optimizer_shardings(plan, abstract_trained, opt_shapes):
    """(optimizer state shardings, update shardings): the state follows its parameter's sharding,
    split further over the rules' shard_optimizer_over axes (the sharded weight update); so does
    the update itself. State not shaped like its parameter (Adafactor's factored rows and columns,
    step counters) is replicated: it is small."""
    rules, mesh = plan.rules, plan.mesh
    opt_shardings = sharding_lib.like_params(
        opt_shapes,
        abstract_trained,
        lambda leaf, p: (
            sharding_lib.update_sharding(rules, mesh, p.sharding, leaf.shape)
            if leaf.shape == p.shape
            else plan.replicated
        ),
        plan.replicated,
    )
    update_shardings = jax.tree.map(
        lambda x: sharding_lib.update_sharding(rules, mesh, x.sharding, x.shape), abstract_trained
    )
    return opt_shardings, update_shardings


def reference_params(cfg, partition: transform.Partition, state) -> dict | None:
    """See Trainer.reference_params."""
    if not preference.reference_model(cfg):
        return None
    if "reference" in state:
        return state["reference"]
    return transform.combine(partition.off(state["params"]), state["frozen"])


def check_reference(partition: transform.Partition, plan) -> None:
    """A preference objective's reference needs the model the run started from: under a model
    transform, the frozen base with the transform off, which exists only when everything that
    trains is something the transform added and can turn off."""
    if partition.freezes and jax.eval_shape(partition.off, partition.split(plan.abstract_params)[0]) is None:
        raise UserError(
            "train.objective = dpo scores against the model the run started from, but the model transform "
            "trains parameters it cannot turn off, so that model is not in the train state; use "
            "train.objective = simpo or orpo (no reference), or train without the transform"
        )


def accumulated(value_and_grad, k: int, micro_sharding, flat_axes, group: int = 1):
    """(params, batch, key) -> (gradients, sums) of `value_and_grad(params, batch, key_i)` over the
    batch's k microbatches, summed (a scan; one call when k is 1). Microbatch i takes rows i, i+k,
    i+2k, ...: the reshape keeps each device's rows on that device, so splitting moves no data.
    `group`: rows that stay together (a preference pair's two sequences), taken as one row."""
    micro_rows = NamedSharding(micro_sharding.mesh, PartitionSpec(*micro_sharding.spec[:2]))

    def one(params, batch, key, i):
        (_, sums), grads = value_and_grad(params, batch, None if key is None else jax.random.fold_in(key, i))
        return grads, sums

    def run(params, batch, key=None):
        if k == 1:
            return one(params, batch, key, 0)

        def split(x_BT):
            if x_BT.ndim == 1:  # one value per row
                B = x_BT.shape[0]
                x_kb = x_BT.reshape(B // (k * group), k, group).swapaxes(0, 1).reshape(k, B // k)
                return x_kb if flat_axes else jax.lax.with_sharding_constraint(x_kb, micro_rows)
            B, T = x_BT.shape
            if group == 1:
                x_kbT = x_BT.reshape(B // k, k, T).swapaxes(0, 1)
            else:
                x_kbT = x_BT.reshape(B // (k * group), k, group, T).swapaxes(0, 1).reshape(k, B // k, T)
            return x_kbT if flat_axes else jax.lax.with_sharding_constraint(x_kbT, micro_sharding)

        def add(carry, microbatch):
            grads, sums = one(params, *microbatch[:1], key, microbatch[1])
            return jax.tree.map(jnp.add, carry, (grads, sums)), None

        first = jax.tree.map(lambda x: x[: x.shape[0] // k], batch)  # shaped as one microbatch
        sums_shape = jax.eval_shape(lambda: one(params, first, key, 0)[1])
        zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape)
        if flat_axes:  # per device in a shard_map: the carry varies over the data axes, as the sums do
            zero_sums = jax.lax.pcast(zero_sums, flat_axes, to="varying")
        zeros = (jax.tree.map(jnp.zeros_like, params), zero_sums)
        return jax.lax.scan(add, zeros, (jax.tree.map(split, batch), jnp.arange(k)))[0]

    return run


def build_trainer(cfg, plan: sharding_lib.ShardingPlan, choices, partition=transform.Partition()) -> Trainer:
    """The jitted steps of `cfg` under `plan`, compiled as the platform `choices` say
    (spmd.assembly.policy.Choices: matmul library, XLA options, how gradients are summed). Only the
    parameters `partition` says train get gradients and optimizer state; the frozen ones are
    carried in the state (spmd.training.transform)."""
    mesh, graphdef, tcfg = plan.mesh, plan.graphdef, cfg.train

    def trained_of(tree):
        return partition.split(tree)[0]

    abstract_trained = trained_of(plan.abstract_params)
    tx = make_optimizer(
        cfg.optimizer, tcfg.steps, trained_of(decay_mask(plan)), trained_of(matrix_dims(plan))
    )
    schedule = lr_schedule(cfg.optimizer, tcfg.steps)
    opt_shardings, update_shardings = optimizer_shardings(
        plan, abstract_trained, jax.eval_shape(tx.init, abstract_trained)
    )
    # optimizer.offload: the state lives in host memory between steps and is streamed to the
    # device for the update (the moves are XLA's, from the memory kinds; spmd/parallel/memory.py).
    offload = cfg.optimizer.offload
    state_shardings = {
        "params": jax.tree.map(lambda x: x.sharding, abstract_trained),
        "opt_state": memory.host_shardings(opt_shardings) if offload else opt_shardings,
        "step": plan.replicated,
    }
    # [sync]: the slices' gradients compressed, or DiLoCo (spmd/parallel/slices.py)
    # (assemble names the slow axes in cfg.sync.axes: none when there is one slice)
    sync_axes = cfg.sync.axis_names() if cfg.sync.active else ()
    sliced_step = None
    if sync_axes:
        slices_lib.check_layout(cfg, plan, sync_axes, update_shardings)
        slices = slices_lib.Slices(mesh, sync_axes)
        inner_micro = sliced.inner_micro_sharding(plan, slices)

        def slice_grads(params, batch, key, frozen):
            value_and_grad = jax.value_and_grad(
                lambda p, b, k: losses_of(p, b, frozen, k, None), has_aux=True
            )
            return accumulated(value_and_grad, tcfg.microbatches, inner_micro, None)(params, batch, key)

        sliced_step = sliced.build(
            cfg, plan, slices,
            grads_and_sums=slice_grads,
            update=lambda st, g, s, max_loss: apply_update(
                st, g, s, max_loss, tx, opt_shardings, update_shardings, offload
            ),
            param_shardings=state_shardings["params"],
            opt_shardings=opt_shardings,
            views=slices_lib.matrix_views(plan, trained_of, cfg.sync.rank) if cfg.sync.compress == "powersgd" else None,
            layered=trained_of(slices_lib.layer_stacked(plan)),
        )  # fmt: skip
        state_shardings["opt_state"] = sliced_step.opt_shardings
        state_shardings["sync"] = sliced_step.sync_shardings
    if partition.freezes:
        state_shardings["frozen"] = partition.split(plan.param_shardings)[1]
    objective, settings = tcfg.objective, cfg.preference
    if preference.reference_model(cfg):
        check_reference(partition, plan)
        if not partition.freezes:  # a frozen copy of the starting weights; a transform's is its base
            state_shardings["reference"] = plan.param_shardings
    frozen_dtype = jnp.dtype(partition.frozen_dtype or cfg.model.param_dtype)

    def from_params(weights):
        """A fresh state from the weights a run starts from; what the transforms add starts fresh
        from the seed (the rest of that draw is dead code)."""
        params = weights
        if partition.freezes:
            params = transform.combine(partition.added(plan.init_params(tcfg.seed)), weights)
        trained, frozen = partition.split(params)
        state = {"params": trained, "opt_state": tx.init(trained), "step": jnp.zeros((), jnp.int32)}
        if sliced_step is not None:
            state["opt_state"], state["sync"] = sliced_step.init(trained, state["opt_state"])
        if partition.freezes:
            state["frozen"] = jax.tree.map(lambda x: x.astype(frozen_dtype), frozen)
        if "reference" in state_shardings:
            state["reference"] = weights
        return state

    seq_perm = context.seq_permutation(plan.rules, mesh, tcfg.seq_len)
    family = plan.family
    aux_weights = family.aux_weights(cfg.model)
    # A scheduled pipeline runs the loss inside its schedule (spmd/parallel/scheduled.py)
    in_schedule = plan.schedule is not None and plan.schedule.scheduled
    if in_schedule and objective != "lm":
        raise UserError(
            f"pipeline.schedule = {plan.schedule.setting} runs the language-model loss inside its schedule; "
            f"train.objective = {objective} needs pipeline.schedule = gpipe or circular with "
            f"pipeline.backward = auto or autodiff (the lockstep loop)"
        )

    def losses_of(params, batch, frozen=None, key=None, reference=None):
        with partition.step_context(key):
            if objective != "lm":
                return preference_losses(
                    graphdef, params if frozen is None else transform.combine(params, frozen), batch,
                    objective=objective, settings=settings, reference=reference, seq_perm=seq_perm,
                    aux_weights=aux_weights, fused_loss=choices.fused_loss,
                )  # fmt: skip
            return token_losses(
                graphdef, params if frozen is None else transform.combine(params, frozen), batch,
                z_loss=tcfg.z_loss, mask_token_id=cfg.data.mask_token_id, seq_perm=seq_perm,
                aux_weights=aux_weights, fused_loss=choices.fused_loss, in_schedule=in_schedule,
            )  # fmt: skip

    micro_sharding = NamedSharding(mesh, PartitionSpec(None, *plan.batch_sharding.spec))
    # Pure data parallelism on CPU across processes: each device's gradient summed as one vector
    # (spmd/parallel/dataparallel.py); the model then traces per device, without activation constraints.
    dense = not family.aux_weights(cfg.model)
    flat_axes = (
        None
        if partition.freezes or objective != "lm" or sliced_step is not None
        else dataparallel.flat_axes(choices.grad_reduce, plan, update_shardings, dense)
    )

    def train_step(state, batch: Batch, max_loss=None):
        frozen = state.get("frozen")
        reference = reference_of(state)
        value_and_grad = jax.value_and_grad(
            lambda p, b, key: losses_of(p, b, frozen, key, reference), has_aux=True
        )
        key = jax.random.fold_in(jax.random.key(tcfg.seed), state["step"]) if partition.needs_key else None
        if sliced_step is not None:
            new_state, metrics, sums = sliced_step.step(state, batch, key, max_loss)
            return finish(state, new_state, metrics, sums)
        group = 1 if objective == "lm" else 2  # a pair's two sequences stay in one microbatch
        grads_and_sums = accumulated(value_and_grad, tcfg.microbatches, micro_sharding, flat_axes, group)
        if flat_axes:
            summed = dataparallel.summed_over(grads_and_sums, mesh, flat_axes, plan.batch_sharding.spec)
            with plan.lowered():
                grads, sums = summed(state["params"], batch)
        else:
            with plan.activate():
                grads, sums = grads_and_sums(state["params"], batch, key)
        new_state, metrics = apply_update(
            state, grads, sums, max_loss, tx, opt_shardings, update_shardings, offload
        )
        return finish(state, new_state, metrics, sums)

    def finish(state, new_state, metrics, sums):
        metrics["learning_rate"] = schedule(state["step"])
        if objective != "lm":  # the pair metrics (TRL's names), means over the pairs
            metrics["aux"] = {**preference.means(sums[3], sums[2]), **family.aux_metrics(sums[3], sums[2])}
            metrics["tokens"] = sums[3]["tokens"]
        else:
            metrics["aux"] = family.aux_metrics(sums[3], sums[2]) if sums[3] else {}  # the model's own
        for name in NOT_SAVED:  # passed through (donated, so not copied)
            if name in state:
                new_state[name] = state[name]
        return new_state, metrics

    def reference_of(state):
        return reference_params(cfg, partition, state)

    def jit_step(*extra):
        return cpu_matmul.jit(
            train_step, choices.matmul, in_shardings=(state_shardings, batch_shardings(cfg, plan), *extra),
            out_shardings=(state_shardings, plan.replicated), donate_argnums=0,
            compiler_options=choices.train_options,
        )  # fmt: skip

    def runnable(step):
        if plan.schedule is None or not plan.schedule.scheduled:
            return step
        return _DivergingStep(step, list(plan.mesh.devices.flat), plan.schedule.setting)

    return Trainer(
        cfg=cfg,
        plan=plan,
        tx=tx,
        state_shardings=state_shardings,
        update_shardings=update_shardings,
        train_step=runnable(jit_step()),
        guarded_step=lambda: runnable(jit_step(plan.replicated)),
        eval_step=build_eval_step(cfg, plan, choices),
        init_state=jax.jit(
            lambda: from_params(partition.without_added(plan.init_params(tcfg.seed))),
            out_shardings=state_shardings,
            compiler_options=choices.init_options,
        ),  # fmt: skip
        state_from_params=jax.jit(from_params, out_shardings=state_shardings),
        flat_grad_axes=flat_axes,
        partition=partition,
    )


def apply_update(state, grads, sums, max_loss, tx, opt_shardings, update_shardings, offload: bool):
    """(new state without `frozen`, metrics): the optimizer's update of the trained parameters from
    the summed gradients. A non-finite loss or gradient, or under spikes.action = skip a loss above
    `max_loss`, leaves parameters and optimizer state as they were (a select, fused into the
    update, so the kept branch is bit-identical)."""
    ce_sum, z_sum, count, _ = sums
    grads = jax.tree.map(lambda g: g / count, grads)
    # Gradients are reduced to where the update runs: the parameters' sharding, or under a
    # sharded weight update each device's slice of it (a reduce-scatter, where the backend has
    # one); the updated parameters are gathered back to their own sharding by out_shardings.
    grads = jax.lax.with_sharding_constraint(grads, update_shardings)
    old_opt_state = jax.device_put(state["opt_state"], opt_shardings) if offload else state["opt_state"]
    updates, opt_state = tx.update(grads, old_opt_state, state["params"])
    updates = jax.lax.with_sharding_constraint(updates, update_shardings)
    params = optax.apply_updates(state["params"], updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(ce_sum) & jnp.isfinite(z_sum) & jnp.isfinite(grad_norm)
    spiked = None if max_loss is None else finite & (ce_sum / count > max_loss)
    keep = finite if spiked is None else finite & ~spiked
    params, opt_state = jax.tree.map(
        lambda new, old: jnp.where(keep, new, old),
        (params, opt_state),
        (state["params"], old_opt_state),
    )
    metrics = {
        "loss": ce_sum / count,
        "z_loss": z_sum / count,
        "grad_norm": grad_norm,
        "tokens": count,
        "skipped": 1 - keep.astype(jnp.int32),
    }
    if spiked is not None:
        metrics["spiked"] = spiked.astype(jnp.int32)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def build_eval_step(cfg, plan: sharding_lib.ShardingPlan, choices):
    """Jitted (params, batch) -> (summed cross-entropy, counted tokens): needs no optimizer, so
    evaluation and sampling build only this. For a preference objective, (params, batch,
    reference) -> (summed loss, pairs, {metric sums}), `reference` None where the objective
    has none (spmd.training.preference)."""
    rules, mesh = plan.rules, plan.mesh
    if cfg.train.objective != "lm":
        return build_preference_eval_step(cfg, plan, choices)

    def eval_step(params, batch: Batch):
        with plan.activate():
            _, (ce_sum, _, count, _) = token_losses(
                plan.graphdef,
                params,
                batch,
                z_loss=0.0,
                mask_token_id=cfg.data.mask_token_id,
                seq_perm=context.seq_permutation(rules, mesh, batch["inputs"].shape[1]),
                fused_loss=choices.fused_loss,
            )
        return ce_sum, count

    return cpu_matmul.jit(
        eval_step,
        choices.matmul,
        in_shardings=(plan.param_shardings, batch_shardings(cfg, plan)),
        out_shardings=plan.replicated,
    )


def build_preference_eval_step(cfg, plan: sharding_lib.ShardingPlan, choices):
    objective = cfg.train.objective

    def eval_step(params, batch: Batch, reference=None):
        with plan.activate():
            _, (loss_sum, _, pairs, sums) = preference_losses(
                plan.graphdef, params, batch, objective=objective, settings=cfg.preference,
                reference=reference, seq_perm=context.seq_permutation(plan.rules, plan.mesh, batch["inputs"].shape[1]),
                fused_loss=choices.fused_loss,
            )  # fmt: skip
        return loss_sum, pairs, sums

    with_reference = preference.reference_model(cfg)
    jitted = cpu_matmul.jit(
        eval_step if with_reference else (lambda params, batch: eval_step(params, batch)),
        choices.matmul,
        in_shardings=(plan.param_shardings, batch_shardings(cfg, plan), *((plan.param_shardings,) if with_reference else ())),
        out_shardings=plan.replicated,
    )  # fmt: skip
    return jitted if with_reference else (lambda params, batch, reference=None: jitted(params, batch))


def preference_held_out(eval_step, params, batches, n_batches: int, reference=None) -> dict:
    """{"loss", "pairs", and each pair metric}: means over the pairs of the first `n_batches`
    held-out batches."""
    total, pairs, sums = 0.0, 0.0, {}
    for i in range(n_batches):
        loss_sum, n, metric_sums = eval_step(params, batches.eval_batch(i), reference)
        total, pairs = total + float(loss_sum), pairs + float(n)
        for name, value in metric_sums.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    means = preference.means(sums, max(pairs, 1.0))
    return {
        "loss": total / max(pairs, 1.0),
        "pairs": int(pairs),
        "tokens": int(sums.get("tokens", 0)),
        **means,
    }


def held_out_sums(
    eval_step, params, batches, n_batches: int, source: str | None = None
) -> tuple[float, float]:
    """(summed cross-entropy, counted tokens) over the first `n_batches` held-out batches (of a
    mixture's `source` when given)."""
    total, count = 0.0, 0.0
    for i in range(n_batches):
        ce_sum, n = eval_step(params, batches.eval_batch(i, source) if source else batches.eval_batch(i))
        total, count = total + float(ce_sum), count + float(n)
    return total, count


def evaluate(trainer: Trainer, params, batches) -> float:
    """Mean held-out cross-entropy per counted token over `eval_batches` fixed batches."""
    total, count = held_out_sums(trainer.eval_step, params, batches, trainer.cfg.train.eval_batches)
    return total / max(count, 1.0)


def held_out_by_source(eval_step, params, batches, n_batches: int) -> tuple[float, float, dict[str, float]]:
    """(summed cross-entropy, counted tokens, {source: mean loss}) over `n_batches` held-out
    batches: of each source for a mixture (the sums over all of them), else of the one split.
    Held-out batches whose masks count no token are an error: their loss would read 0."""
    if not batches.val_sources:
        total, count = held_out_sums(eval_step, params, batches, n_batches)
        _check_counted(count, "the held-out split", n_batches)
        return total, count, {}
    total, count, per_source = 0.0, 0.0, {}
    for name in batches.val_sources:
        t, n = held_out_sums(eval_step, params, batches, n_batches, name)
        _check_counted(n, f"the held-out split of source {name!r}", n_batches)
        per_source[name] = t / n
        total, count = total + t, count + n
    return total, count, per_source


def _check_counted(count: float, what: str, n_batches: int) -> None:
    if not count:
        raise UserError(
            f"{what} counts no token in {n_batches} batch(es): every target is masked out (chat data whose "
            f"loss masks select nothing there, or data.mask_token_id everywhere), so its loss would read 0; "
            f"prepare the data so the held-out conversations have trained turns (--train-on), or evaluate other data"
        )


def evaluate_all(trainer: Trainer, params, batches, reference=None) -> dict[str, float]:
    """{"eval_loss": ...}; for a mixture, eval_loss/<name> per source over `eval_batches` batches
    of each, and eval_loss their mean per counted token. A preference objective: its mean loss
    over the held-out pairs and eval_<metric> for its pair metrics (`reference`: the reference
    model's parameters, where it has one)."""
    if trainer.cfg.train.objective != "lm":
        found = preference_held_out(
            trainer.eval_step, params, batches, trainer.cfg.train.eval_batches, reference
        )
        return {"eval_loss": found["loss"], **{f"eval_{k}": v for k, v in found.items() if "/" in k}}
    total, count, per_source = held_out_by_source(
        trainer.eval_step, params, batches, trainer.cfg.train.eval_batches
    )
    return {"eval_loss": total / max(count, 1.0), **{f"eval_loss/{k}": v for k, v in per_source.items()}}
