"""Model families: what the engine knows of a model, and how it finds one by name.

A family is a package of `spmd.models` (the repository's models/ folder: `model.family = "gpt2"`
is `spmd.models.gpt2`) or any importable module (`model.family = "mypackage.mymodel"`) with a
module-level `FAMILY = ModelFamily(...)`. The engine (everything under spmd/ outside spmd.models)
reads a model only through this contract and imports no family: it finds one by name at run time.

What a family gives the engine:

- its config class (a frozen dataclass: the `[model]` table, with `check()`; a field holding
  another dataclass is a table of its own, e.g. `[moe]`) and its Flax NNX module class, built as
  `model_cls(cfg, rngs=...)`, whose parameters carry logical axis names;
- the logical axis names it adds to the engine's (spmd.core.rules.LOGICAL_AXES), and the shapes of the
  activations it constrains, so rules are checked before anything is compiled;
- `Figures`: parameter and FLOP counts and the sizes cost models and planners read;
- its KV cache for decoding;
- its auxiliary losses by name (`Aux`), their weights and the metrics made of their statistics;
- optionally a Hugging Face adapter (`HFAdapter`): config and tensor-name mappings;
- the projections a model transform may adapt (`adapter_targets`).

The engine reads a few settings of every family config by name: `vocab_size`, `d_model`,
`n_layers`, `dtype` (compute), `param_dtype`, `remat` and `attention_impl`.
"""

import dataclasses
import functools
import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping
from typing import NamedTuple

from spmd.core.errors import UserError, closest

DEFAULT = "llama"
BUILTIN = "spmd.models"


def adapter_of(module, weight: str):
    """The adapter a model transform (spmd.training.transform) attached to `module` beside its
    parameter `weight`: a submodule whose `adapts` names it, called as `adapter(x, n_in,
    lead_axes)` for its update of x's projection; None when there is none (the model runs
    unchanged)."""
    for value in vars(module).values():
        if getattr(value, "adapts", None) == weight:
            return value
    return None


@dataclasses.dataclass(frozen=True)
class Figures:
    """One model config's sizes as cost models, planners and the log read them, at one sequence
    length."""

    params: int
    active_params: int  # those one token uses (an MoE layer's k routed experts, not all E)
    flops_per_token: float  # training: 6 x active matmul parameters + attention (causal: halved)
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    n_experts: int = 0  # routed experts of an MoE layer; 0: a dense model
    moe_layers: int = 0  # layers whose MLP is a mixture of experts
    expert_capacity: int = 0  # token slots per expert for one sequence (capacity dispatch)
    max_positions: int | None = (
        None  # the longest sequence the model can take (a learned position table); None: any
    )

    def dispatched_shape(self, batch: int) -> tuple[int, int, int, int]:
        """(B, E, C, D): the tokens of `batch` sequences dispatched to an MoE layer's experts."""
        return batch, self.n_experts, self.expert_capacity, self.d_model


class Aux(NamedTuple):
    """A forward pass's auxiliary outputs beside its logits, by name, stacked over the layers that
    make them (a leading axis of one row per such layer).

    `losses`: each a mean over this batch's tokens per layer; the trainer adds, per counted token,
    the family's weight (`ModelFamily.aux_weights`) times its mean over the layers. `sums`:
    statistics summed over the batch (counts), summed again over microbatches; the family turns
    them into logged metrics (`ModelFamily.aux_metrics`)."""

    losses: dict
    sums: dict

    def of_microbatches(self, n: int) -> "Aux":
        """The outputs of a batch run as n microbatches, from their sums over the microbatches: the
        losses (each a mean over its microbatch) averaged, the sums kept."""
        return Aux({k: v / n for k, v in self.losses.items()}, self.sums)


class Tail(NamedTuple):
    """What follows the model's logits in training, handed to the model so a pipeline can run it on
    each microbatch as it leaves the last stage (spmd/parallel/scheduled.py).

    `fn(logits, rows) -> (loss, sums)`: the summed loss of some rows and additive statistics
    (pytree); `rows`: its per-row inputs (targets, masks; leading axis the batch);
    `aux_loss(aux) -> loss`: the term the model's auxiliary losses (an Aux, or None) add, linear
    in them."""

    fn: Callable
    rows: object
    aux_loss: Callable


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """How one of our parameters is stored in Hugging Face's files.

    Our array has `stacked` leading axes (layers, then experts) that index separate HF tensors
    (`name(*indices)`); each HF tensor, transposed when `transpose` (HF Linear is (out, in)),
    reshapes to our per-layer shape by splitting its axes into the `groups` of our axes: q_proj
    (N*H, D) transposed is (D, N*H), our (D, N, H) with groups ((0,), (1, 2)). `part` = (axis,
    index, count): our array is the index-th of `count` equal parts of the (transposed) HF tensor
    along `axis` (GPT-2's fused q/k/v projection holds three of ours).
    """

    name: Callable[..., str]
    stacked: int = 0
    transpose: bool = False
    groups: tuple[tuple[int, ...], ...] = ()
    part: tuple[int, int, int] | None = None

    def _groups(self, shape):
        return self.groups or tuple((d,) for d in range(len(shape)))

    def _dims(self, shape) -> tuple[int, ...]:
        """Our per-layer `shape` as the (untransposed) HF axes it fills: our part of them."""
        return tuple(math.prod(shape[d] for d in g) for g in self._groups(shape))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole HF tensor's shape for our (per-layer) `shape`."""
        dims = list(self._dims(shape))
        if self.part is not None:
            dims[self.part[0]] *= self.part[2]
        return tuple(dims[::-1] if self.transpose else dims)

    def read(self, tensor_slice, shape: tuple[int, ...], index: tuple[slice, ...]) -> "np.ndarray":  # noqa: F821
        """Our per-layer array's `index` block, reading from the HF tensor only the rows/columns
        that cover it (for a grouped axis: whole inner groups, e.g. whole heads)."""
        groups = self._groups(shape)
        ranges = [index[d].indices(shape[d])[:2] for d in range(len(shape))]
        dims = self._dims(shape)
        hf_index, block_shape = [], []
        for axis, g in enumerate(groups):
            inner = math.prod(shape[d] for d in g[1:])
            start, stop = ranges[g[0]]
            offset = self.part[1] * dims[axis] if self.part is not None and self.part[0] == axis else 0
            hf_index.append(slice(offset + start * inner, offset + stop * inner))
            block_shape += [stop - start, *(shape[d] for d in g[1:])]
        block = tensor_slice[tuple(hf_index[::-1] if self.transpose else hf_index)]
        block = (block.T if self.transpose else block).reshape(block_shape)
        local = tuple(slice(None) if d == g[0] else slice(*ranges[d]) for g in groups for d in g)
        return block[local]

    def write(self, ours):
        """Our per-layer array laid out as its HF tensor (for a `part`: as its part of it, in
        the HF layout; `join` puts the parts together)."""
        import numpy as np

        flat = ours.reshape(self._dims(ours.shape))
        return np.ascontiguousarray(flat.T if self.transpose else flat)

    def join(self, parts: list) -> "np.ndarray":  # noqa: F821
        """The HF tensor from its parts (each `write`'s output), in part order."""
        import numpy as np

        if len(parts) == 1:
            return parts[0]
        axis = parts[0].ndim - 1 - self.part[0] if self.transpose else self.part[0]
        return np.ascontiguousarray(np.concatenate(parts, axis=axis))


@dataclasses.dataclass(frozen=True)
class HFAdapter:
    """A family's mapping to and from Hugging Face `transformers` checkpoints.

    `architectures`: the HF architectures it reads and writes, each with its `model_type`.
    `model_fields(hf_config, source)`: the family config's fields for an HF config.json (a dict),
    or UserError naming what it cannot express. `export_architecture(cfg, imported_config)`: the
    architecture that expresses `cfg` (UserError where none does). `hf_config(cfg, arch,
    imported_config, max_positions, dtype)`: config.json for `cfg`. `tensors(cfg)`: our parameter
    path -> its HFTensor, for every parameter. `unmapped(cfg, name)`: whether a tensor in the
    files that no parameter maps is known and skipped (buffers, a tied head saved twice).
    `export_note(cfg)`: a line for the user about what the export changes ("" for none)."""

    architectures: Mapping[str, str]
    model_fields: Callable[[dict, str], dict]
    export_architecture: Callable[[object, dict | None], str]
    hf_config: Callable[[object, str, dict | None, int, str], dict]
    tensors: Callable[[object], dict]
    unmapped: Callable[[object, str], bool] = lambda cfg, name: False
    export_note: Callable[[object], str] = lambda cfg: ""


def _no_aux(cfg) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """What the engine needs of a model (module doc).

    `activations(cfg, batch, seq_len)`: name -> (logical axes, shape) of each activation the model
    constrains in training. `cache_axes(cfg, per_layer)`: name -> logical axes of each array of
    its KV cache (validated under the decoding rules). `empty_cache(cfg, batch, slots,
    per_layer)`: a cache for decoding (`per_layer`: one array per layer, what XLA:CPU updates in
    place; spmd.platform decides). `cache_shardings(cfg, per_layer, sharding)`: the cache's
    structure with `sharding(logical axes)` at each array. `logical_axes`: names the family adds
    to the engine's, each with the engine name whose mapping it takes where a rules file does not
    map it (None: replicated). `adapter_targets`: the projections a model transform may adapt
    (spmd.training.transform; low-rank adapters use them), each
    short name (q, k, v, o, gate, up, down) with the weight's attribute name in its module and how
    many of its leading axes the projection contracts (the module passes `adapter(self, name)`
    to `project`).
    """

    name: str
    config_cls: type
    model_cls: type
    figures: Callable[[object, int], Figures]
    activations: Callable[[object, int, int], dict]
    cache_axes: Callable[[object, bool], dict]
    empty_cache: Callable[[object, int, int, bool], object]
    cache_shardings: Callable[[object, bool, Callable], object]
    logical_axes: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    aux_weights: Callable[[object], dict] = _no_aux
    aux_metrics: Callable[[dict, object], dict] = lambda sums, count: {}
    hf: HFAdapter | None = None
    adapter_targets: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=dict)


def builtin() -> list[str]:
    """The families of spmd.models."""
    package = importlib.import_module(BUILTIN)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)


@functools.cache
def find(name: str) -> ModelFamily:
    """The family `name`: a package of spmd.models, or a module path holding FAMILY."""
    module_name = name if "." in name else f"{BUILTIN}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # the family's own imports failed: not a wrong name
        known = builtin()
        raise UserError(
            f"unknown model family {name!r}{closest(name, known)}; families are {', '.join(known)}, "
            f"or a module path whose module defines FAMILY"
        ) from None
    except Exception as e:  # noqa: BLE001 — any failure of a user's family module is its own
        raise UserError(
            f"model family {name!r}: importing {module_name} failed ({type(e).__name__}: {str(e)[:200]}); fix "
            f"that module, or choose another family"
        ) from None
    family = getattr(module, "FAMILY", None)
    if not isinstance(family, ModelFamily):
        raise UserError(f"model family {name!r}: module {module_name} defines no FAMILY (a ModelFamily)")
    return family


def of(model_cfg) -> ModelFamily:
    """The family a model config belongs to (its class names it: `family`)."""
    return find(type(model_cfg).family)


def for_architecture(arch: str) -> ModelFamily | None:
    """The built-in family whose HF adapter reads `arch`, or None."""
    for name in builtin():
        family = find(name)
        if family.hf is not None and arch in family.hf.architectures:
            return family
    return None


def architectures() -> list[str]:
    """Every HF architecture the built-in families read."""
    return [a for name in builtin() if find(name).hf for a in find(name).hf.architectures]
