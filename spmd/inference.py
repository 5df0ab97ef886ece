"""Evaluate and sample from checkpoints on any mesh.

Sampling is KV-cache decoding: one prefill over the (left-padded) prompts, then one jitted step per
new token. The cache is sharded by the rules' `kv cache` axes (batch over the data axes, kv heads
over tensor).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from models.llama import KV_CACHE_AXES, KVCache
from spmd import checkpoint as ckpt
from spmd import sharding as sharding_lib
from spmd.config import SECTIONS, config_from_json
from spmd.errors import UserError
from spmd.logical import activation_sharding
from spmd.mesh import build_mesh
from spmd.rules import load_rules
from spmd.train import build_trainer


@dataclasses.dataclass
class Loaded:
    cfg: object
    step: int
    meta: dict
    trainer: object
    params: dict

    @property
    def plan(self):
        return self.trainer.plan


def default_rules(meta: dict) -> str:
    """The rules the run was trained with, when they are still a preset or an existing file."""
    name = meta.get("run", {}).get("rules", {}).get("name", "fsdp")
    try:
        load_rules(name)
        return name
    except UserError:
        return "fsdp"


def load(
    path: str,
    step: int | None,
    mesh_spec: str,
    rules_name: str | None,
    overrides=(),
    batch: int | None = None,
    seq_len: int | None = None,
    decoding: bool = False,
) -> Loaded:
    """Restore a checkpoint's parameters onto `mesh_spec` x rules (default: the run's own rules);
    `decoding`: for KV-cache generation (see Rules.for_decoding)."""
    directory, latest = ckpt.locate(path)
    if step is not None:
        if step not in ckpt.committed_steps(directory):
            raise UserError(
                f"no committed checkpoint for step {step} in {directory} "
                f"(committed: {', '.join(map(str, ckpt.committed_steps(directory))) or 'none'})"
            )
        latest = step
    meta = ckpt.read_meta(directory, latest)
    cfg = config_from_json(meta["run"]["config"])
    if overrides:
        from spmd.config import _set

        tree = {s: dict(dataclasses.asdict(getattr(cfg, s))) for s in SECTIONS}
        for item in overrides:
            key, _, value = item.partition("=")
            _set(tree, key, value, "--set")
        cfg = config_from_json({"name": cfg.name, **tree})
    mesh = build_mesh(mesh_spec)
    rules = load_rules(rules_name or default_rules(meta)).with_attention(cfg.attention)
    if decoding:
        rules = rules.for_decoding()
    # batch 0: the smallest batch the mesh can split (sampling pads its prompts up to a multiple).
    B = batch if batch is not None else cfg.train.global_batch_size
    B = B or math.prod(dict(mesh.shape)[a] for a in rules.mapping.get("batch", ()))
    plan = sharding_lib.plan(cfg.model, mesh, rules, B, seq_len or cfg.train.seq_len)
    trainer = build_trainer(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=B, microbatches=1)),
        plan,
    )
    state, meta = ckpt.restore(directory, latest, trainer.abstract_state)
    return Loaded(cfg, latest, meta, trainer, state["params"])


def evaluate(loaded: Loaded, batches, n_batches: int) -> dict:
    """Held-out cross-entropy (nats/token), perplexity and bits per byte (byte-level vocabularies)."""
    total, count = 0.0, 0.0
    for i in range(n_batches):
        ce_sum, n = loaded.trainer.eval_step(loaded.params, batches.eval_batch(i))
        total, count = total + float(ce_sum), count + float(n)
    loss = total / max(count, 1.0)
    byte_level = loaded.cfg.model.vocab_size == 256 and not loaded.cfg.data.path.endswith((".npy", ".bin"))
    return {
        "step": loaded.step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2) if byte_level else None,
        "tokens": int(count),
        "batches": n_batches,
    }


def batch_multiple(loaded: Loaded) -> int:
    """The batch must divide by the product of the mesh axes that `batch` maps to."""
    sizes = dict(loaded.plan.mesh.shape)
    return math.prod(sizes[a] for a in loaded.plan.rules.mapping["batch"])


class Sampler:
    """Jitted prefill and decode steps for one loaded model on its mesh."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.cfg = loaded.cfg.model
        plan = loaded.plan
        self.cache_sharding = plan.rules.sharding(plan.mesh, KV_CACHE_AXES)
        graphdef, mesh, rules = plan.graphdef, plan.mesh, plan.rules

        def forward(params, tokens_BT, positions_BT, cache):
            with activation_sharding(rules, mesh):
                logits_BTV, cache = nnx.merge(graphdef, params)(tokens_BT, positions_BT, cache)
            return logits_BTV[:, -1].astype(jnp.float32), cache

        self.forward = jax.jit(forward, donate_argnums=3)
        self.replicated = plan.replicated

    def empty_cache(self, batch: int, slots: int) -> KVCache:
        shardings = KVCache(
            self.cache_sharding,
            self.cache_sharding,
            NamedSharding(self.loaded.plan.mesh, self.loaded.plan.batch_sharding.spec),
            self.replicated,
        )
        return jax.jit(lambda: KVCache.empty(self.cfg, batch, slots), out_shardings=shardings)()

    def generate(
        self,
        prompts: list[np.ndarray],
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        seed: int,
        on_token=None,
    ) -> list[np.ndarray]:
        """New tokens for each prompt; `on_token(t, tokens_B)` is called as each step's tokens arrive."""
        n = len(prompts)
        B = -(-n // batch_multiple(self.loaded)) * batch_multiple(self.loaded)
        P = max(len(p) for p in prompts)
        tokens_BP = np.zeros((B, P), np.int32)
        pad_B = np.full((B,), P, np.int32)
        for i, p in enumerate(prompts):
            tokens_BP[i, P - len(p) :] = p
            pad_B[i] = P - len(p)
        positions_BP = np.arange(P)[None, :] - pad_B[:, None]  # padding gets negative positions: masked
        cache = self.empty_cache(B, P + max_new_tokens)
        logits_BV, cache = self.forward(self.loaded.params, tokens_BP, positions_BP, cache)
        key = jax.random.key(seed)
        out = np.zeros((B, max_new_tokens), np.int32)
        for t in range(max_new_tokens):
            next_B = np.asarray(pick(logits_BV, jax.random.fold_in(key, t), temperature, top_k))
            out[:, t] = next_B
            if on_token is not None:
                on_token(t, next_B[:n])
            if t + 1 < max_new_tokens:
                positions_B1 = (P - pad_B + t)[:, None]
                logits_BV, cache = self.forward(self.loaded.params, next_B[:, None], positions_B1, cache)
        return [out[i] for i in range(n)]


@jax.jit
def _greedy(logits_BV):
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def pick(logits_BV, key, temperature: float, top_k: int):
    """Greedy when temperature is 0; else sample from softmax(logits / temperature) over the top k."""
    if temperature == 0:
        return _greedy(logits_BV)
    return _sample(logits_BV, key, jnp.float32(temperature), top_k)


@jax.jit(static_argnames="top_k")
def _sample(logits_BV, key, temperature, top_k: int):
    logits_BV = logits_BV / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def encode(text: str, cfg) -> np.ndarray:
    if cfg.model.vocab_size != 256 or cfg.data.path.endswith((".npy", ".bin")):
        raise UserError(
            "spmd-sample reads text prompts as bytes, so it needs a byte-level model (vocab_size 256, "
            "trained on text); this run used pre-tokenized data"
        )
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
