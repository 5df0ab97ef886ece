"""Evaluate and sample from checkpoints on any mesh.

Sampling is KV-cache decoding: one prefill over the (left-padded) prompts, then one jitted step per
new token. The cache is the model family's (spmd.core.family), sharded by its logical axes under the
rules (batch over the data axes, kv heads over tensor), laid out as the platform choices say.
"""

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd.assembly.config import apply_overrides, config_from_json
from spmd.assembly.setup import Setup, assemble
from spmd.core.errors import UserError, log
from spmd.core.mesh import axes_size
from spmd.core.rules import load_rules
from spmd.io import checkpoint as ckpt
from spmd.parallel.sharding import path_str
from spmd.training import transform
from spmd.training.trainer import held_out_by_source, preference_held_out


@dataclasses.dataclass
class Loaded:
    """A checkpoint's parameters placed on a mesh, with the set-up that placed them."""

    setup: Setup  # assembled without an optimizer
    step: int
    meta: dict
    params: dict
    run_dir: pathlib.Path | None = None  # where the run's other files (its tokenizer) lie

    @property
    def cfg(self):
        return self.setup.cfg

    @property
    def plan(self):
        return self.setup.plan


def default_rules(meta: dict) -> str:
    """The rules the run was trained with, when they are still a preset or an existing file."""
    name = meta.get("run", {}).get("rules", {}).get("name", "fsdp")
    try:
        load_rules(name)
        return name
    except UserError:
        return "fsdp"


def load(path: str, step: int | None, mesh_spec: str, rules_name: str | None, overrides=(),
         batch: int | None = None, decoding: bool = False, objective: bool = False,
         devices=None) -> Loaded:  # fmt: skip
    """Restore a checkpoint's parameters (never its optimizer state) onto `mesh_spec` x rules
    (default: the run's own rules). `batch`: the batch the steps are compiled for (default the
    run's global batch; 0: the smallest the mesh splits). `decoding`: for KV-cache generation
    (see Rules.for_decoding). `objective`: keep the run's train.objective (its eval step scores
    preference pairs); otherwise the model is loaded as a language model. The latest checkpoint
    of a live run that its retention deletes while it is read is read again at the new latest,
    and said. `devices`: the devices the mesh is built of (default: all of them)."""
    try:
        return _load(path, step, mesh_spec, rules_name, overrides, batch, decoding, objective, devices)
    except ckpt.Rotated as e:
        if step is not None:
            raise
        log(f"note: {e}; reading the newest checkpoint again")
        return _load(path, step, mesh_spec, rules_name, overrides, batch, decoding, objective, devices)


def _load(path, step, mesh_spec, rules_name, overrides, batch, decoding, objective, devices) -> Loaded:
    directory, latest = ckpt.locate(path)
    if step is not None:
        if step not in ckpt.committed_steps(directory):
            raise UserError(
                f"no committed checkpoint for step {step} in {directory} "
                f"(committed: {', '.join(map(str, ckpt.committed_steps(directory))) or 'none'})"
            )
        latest = step
    meta = ckpt.check_meta(directory, latest, ckpt.read_meta(directory, latest), ("run",))
    # A run with model transforms is evaluated and sampled as its merged model (adapters folded in).
    cfg = transform.plain(config_from_json(meta["run"]["config"]))
    if not objective:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="lm"))
    setup = assemble(
        cfg,
        mesh_spec,
        rules_name or default_rules(meta),
        overrides=overrides,
        optimizer=False,
        decoding=decoding,
        devices=devices,
        # the run's global batch, or the one --set asks for
        batch_size=batch if batch is not None else apply_overrides(cfg, overrides).train.global_batch_size,
    )
    params, meta = ckpt.restore_model(directory, latest, setup.plan, meta)
    params = setup.plan.from_canonical(params, setup.plan.param_shardings)  # checkpoints: canonical order
    return Loaded(setup, latest, meta, params, ckpt.run_dir_of(directory))


def evaluate(loaded: Loaded, batches, n_batches: int) -> dict:
    """Held-out cross-entropy (nats/token), perplexity and bits per byte (where the data knows its
    text's size: bytes, or data prepared by spmd-data prepare)."""
    # A mixture: each source's held-out batches, and all of them together.
    total, count, sources = held_out_by_source(loaded.setup.eval_step, loaded.params, batches, n_batches)
    loss = total / max(count, 1.0)
    per_token = batches.val_bytes_per_token
    result = {
        "step": loaded.step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2) / per_token if per_token else None,
        "tokens": int(count),
        "batches": n_batches,
    }
    if sources:
        result["sources"] = sources
    return result


def compute_note(loaded: Loaded) -> str:
    """The line spmd-sample and spmd-eval say of the precision they compute in."""
    model = loaded.cfg.model
    line = f"computing in {model.dtype} (model.dtype; parameters {model.param_dtype})"
    if model.dtype != "float32":
        line += ": transformers' float32 numbers are matched with --set model.dtype=float32"
    return line


def reference(loaded: Loaded):
    """The reference model of a preference run (its starting weights: the `--init-from`
    checkpoint, else its seed) on the loaded model's mesh, or None for an objective without one."""
    from spmd.training import preference

    if not preference.needs_reference(loaded.cfg.train.objective):
        return None
    plan = loaded.plan

    def fresh(seed):
        return jax.jit(lambda: plan.init_params(seed), out_shardings=plan.param_shardings)()

    weights = ckpt.starting_weights(loaded.meta.get("run", {}), plan.abstract_params, fresh,
                                    f"the run of checkpoint step {loaded.step}")  # fmt: skip
    return plan.from_canonical(weights, plan.param_shardings)


def evaluate_preference(loaded: Loaded, batches, n_batches: int) -> dict:
    """A preference run's held-out loss and pair metrics (reward accuracy and margins against its
    reference, the policy's log-probabilities: spmd.training.preference) over `n_batches` batches."""
    found = preference_held_out(loaded.setup.eval_step, loaded.params, batches, n_batches, reference(loaded))
    return {"step": loaded.step, "objective": loaded.cfg.train.objective, "batches": n_batches, **found}


def write_reference(loaded: Loaded, data_dir: str) -> dict:
    """The loaded model's log-probability of each completion of the prepared preference pairs in
    `data_dir` (both splits, in document order), written beside them for a DPO run with
    preference.reference = precomputed (spmd.data.preference.write_reference); returns its record."""
    from spmd.data import preference as pairs
    from spmd.data.loader import TokenStream
    from spmd.data.prepare import read_manifest
    from spmd.training import preference
    from spmd.training.trainer import forward_ce

    directory = pathlib.Path(data_dir)
    manifest = read_manifest(directory)
    if "preference" not in manifest:
        raise UserError(
            f"--write-reference: {data_dir!r} is not preference data (spmd-data prepare --format preference)"
        )
    plan, T = loaded.plan, loaded.cfg.train.seq_len
    rows = loaded.cfg.train.global_batch_size  # pairs per call: two rows each
    sharding = plan.batch_sharding

    @jax.jit
    def logps(params, batch):
        with plan.activate():
            ce_BT = forward_ce(plan.graphdef, params, batch["inputs"], batch["targets"], None, None, None,
                               loaded.setup.choices.fused_loss)[0]  # fmt: skip
        return preference.row_sums(ce_BT, batch["loss_mask"], batch["target_mask"])[0]

    found = {}
    for split in ("train", "val"):
        source = pairs.PairSource(TokenStream(directory, manifest, split), T, f"{data_dir!r} ({split})")
        values = []
        for first in range(0, len(source), rows):
            chunk = [
                source[min(i, len(source) - 1)] for i in range(first, first + rows)
            ]  # the last one padded
            windows = np.stack(chunk).reshape(2 * rows, *chunk[0].shape[1:])
            batch = {
                name: jax.device_put(windows[:, j], sharding) for j, name in enumerate(preference.FIELDS)
            }
            values.append(
                np.asarray(logps(loaded.params, batch))[: 2 * (min(first + rows, len(source)) - first)]
            )
        found[split] = np.concatenate(values) if values else np.zeros(0, np.float32)
    directory_of, _ = ckpt.locate(str(loaded.run_dir)) if loaded.run_dir else (None, None)
    record = {
        "checkpoint": str((directory_of / str(loaded.step)).resolve()) if directory_of else "",
        "step": loaded.step,
        "data_key": manifest.get("key"),
        "sequences": {split: len(v) for split, v in found.items()},
    }
    pairs.write_reference(directory, record, found)
    return record


def batch_multiple(loaded: Loaded) -> int:
    """The batch must divide by the product of the mesh axes that `batch` maps to."""
    return axes_size(loaded.plan.mesh.shape, loaded.plan.rules.mapping["batch"])


class Sampler:
    """Jitted prefill and decode steps for one loaded model on its mesh."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.cfg = loaded.cfg.model
        plan = loaded.plan
        self.family = plan.family
        graphdef = plan.graphdef
        # On CPU (spmd.assembly.policy) each layer's weights and caches are arrays of their own, and given
        # per-layer caches the model runs its layers as a Python loop: XLA:CPU copies a slice of a
        # stacked array, which was every layer's weights and caches for every token, while a
        # stack built in the program from its layers folds into them and a layer's own cache is
        # written in place. The weights are split here once, a second copy (in the compute dtype)
        # while the caller keeps `loaded.params`.
        self.per_layer = loaded.setup.choices.kv_cache_per_layer
        self.params = decoding_params(loaded.params, plan, split=self.per_layer)

        def forward(params, tokens_BT, positions_BT, cache):
            params = stack_layers(params)
            with plan.activate():
                logits_BTV, cache = nnx.merge(graphdef, params)(tokens_BT, positions_BT, cache)
            return logits_BTV[:, -1].astype(jnp.float32), cache

        def decode(params, tokens_BT, positions_BT, cache, key, t, temperature, top_k):
            logits_BV, cache = forward(params, tokens_BT, positions_BT, cache)
            return _choose(logits_BV, jax.random.fold_in(key, t), temperature, top_k), cache

        self.forward = jax.jit(forward, donate_argnums=3)
        # One dispatch per new token: the forward step, the key and the sampling in one program
        # (a dispatch is a noticeable share of a small model's token step on CPU).
        self.decode = jax.jit(decode, donate_argnums=3, static_argnames=("temperature", "top_k"))
        self.replicated = plan.replicated

    def empty_cache(self, batch: int, slots: int):
        """The family's KV cache for `batch` sequences of `slots` positions, placed on the mesh."""
        plan = self.loaded.plan
        shardings = self.family.cache_shardings(
            self.cfg, self.per_layer, lambda axes: plan.rules.sharding(plan.mesh, axes)
        )
        return jax.jit(
            lambda: self.family.empty_cache(self.cfg, batch, slots, self.per_layer), out_shardings=shardings
        )()

    def generate(
        self,
        prompts: list[np.ndarray],
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        seed: int,
        on_token=None,
        stop: set[int] = frozenset(),
    ) -> list[np.ndarray]:
        """New tokens for each prompt; `on_token(t, tokens_B)` is called as each step's tokens arrive.
        Decoding ends early once every prompt has drawn one of the `stop` tokens (what follows it
        in a row is filler)."""
        n = len(prompts)
        B = -(-n // batch_multiple(self.loaded)) * batch_multiple(self.loaded)
        P = max(len(p) for p in prompts)
        longest = self.family.figures(self.cfg, self.loaded.cfg.train.seq_len).max_positions
        if longest is not None and P + max_new_tokens > longest:
            raise UserError(
                f"a prompt of {P} tokens and {max_new_tokens} new ones need {P + max_new_tokens} positions; "
                f"model family {self.family.name} takes at most {longest}: ask for fewer new tokens"
            )
        tokens_BP = np.zeros((B, P), np.int32)
        pad_B = np.full((B,), P, np.int32)
        for i, p in enumerate(prompts):
            tokens_BP[i, P - len(p) :] = p
            pad_B[i] = P - len(p)
        positions_BP = np.arange(P)[None, :] - pad_B[:, None]  # padding gets negative positions: masked
        cache = self.empty_cache(B, P + max_new_tokens)
        logits_BV, cache = self.forward(self.params, tokens_BP, positions_BP, cache)
        key = jax.random.key(seed)
        out = np.zeros((B, max_new_tokens), np.int32)
        stopped = np.zeros(n, bool)
        # Token t is drawn with fold_in(key, t), from the logits after token t-1.
        next_B = np.asarray(pick(logits_BV, jax.random.fold_in(key, 0), temperature, top_k))
        for t in range(max_new_tokens):
            out[:, t] = next_B
            if on_token is not None:
                on_token(t, next_B[:n])
            stopped |= np.isin(next_B[:n], list(stop))
            if stopped.all():
                return [out[i, : t + 1] for i in range(n)]
            if t + 1 < max_new_tokens:
                positions_B1 = (P - pad_B + t)[:, None]
                next_B, cache = self.decode(
                    self.params,
                    next_B[:, None],
                    positions_B1,
                    cache,
                    key,
                    t + 1,
                    float(temperature),
                    top_k,
                )
                next_B = np.asarray(next_B)
        return [out[i] for i in range(n)]


def decoding_params(params: dict, plan, split: bool) -> dict:
    """The parameters as the token step reads them, made once: those the model casts to the compute
    dtype where it uses them (`ParamInfo.compute_cast`) cast (the same values every token read
    before; in bfloat16 the step re-cast every weight per token); with `split`, each stacked-layer
    parameter (`plan.layered`) as a tuple of its layers, placed as the stack was less its leading
    axis (decoding never splits the layers over devices)."""
    dtype = jnp.dtype(plan.model_cfg.dtype)
    cast = {p.path for p in plan.params if p.compute_cast}

    def made(path, a):
        a = a.astype(dtype) if path_str(path) in cast else a
        return tuple(a[i] for i in range(a.shape[0])) if split and path_str(path) in plan.layered else a

    def placed(path, s):
        if not (split and path_str(path) in plan.layered):
            return s
        return (one_layer(s),) * plan.layered[path_str(path)]

    shardings = jax.tree_util.tree_map_with_path(placed, plan.param_shardings)
    return jax.jit(lambda p: jax.tree_util.tree_map_with_path(made, p), out_shardings=shardings)(params)


def one_layer(stacked: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stack placed as `stacked` (its leading axis dropped)."""
    return NamedSharding(stacked.mesh, PartitionSpec(*stacked.spec[1:]))


def stack_layers(params: dict) -> dict:
    """`decoding_params`' split undone inside a traced program (a no-op on stacked parameters)."""
    return jax.tree.map(
        lambda x: jnp.stack(x) if isinstance(x, tuple) else x, params, is_leaf=lambda x: isinstance(x, tuple)
    )


def pick(logits_BV, key, temperature: float, top_k: int):
    """Greedy when temperature is 0; else sample from softmax(logits / temperature) over the top k."""
    return _pick(logits_BV, key, float(temperature), top_k)


def _choose(logits_BV, key, temperature: float, top_k: int):
    """`pick` inside a traced program (temperature and top_k static)."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return _sample_math(logits_BV, key, jnp.float32(temperature), top_k)


_pick = jax.jit(_choose, static_argnames=("temperature", "top_k"))


def _sample_math(logits_BV, key, temperature, top_k: int):
    logits_BV = logits_BV / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)
