"""Model transforms: what changes a model family before it is parallelised, and which of its
parameters train.

A transform owns a config table (its `table`); a run whose config turns the table on gets the
transform applied to its family in spmd.assembly.setup, before the sharding plan, so the
parameters it adds carry logical axes and every rules file shards them. The trainer sees only a
`Partition`: which parameters train (gradients, optimizer state, checkpoints) and which are frozen
(carried in the state as `frozen`, never differentiated, never saved). Frozen parameters never
change, so a checkpoint need not hold them: they are the weights the run started from (its
`--init-from` checkpoint, else its seed), as spmd.io.checkpoint restores them.

Transforms are found like model families: each module of the `spmd.transforms` package that
defines `TRANSFORM` (a ModelTransform subclass) is one, so a new transform is one module there
and a config table, with no edit to the trainer or the checkpoints.
"""

import abc
import contextlib
import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping

PACKAGE = "spmd.transforms"
Path = tuple  # a parameter's path in the tree, as jax.tree_util gives it


class ModelTransform(abc.ABC):
    """One transform of a model family, made from its config table (`settings`)."""

    table: str = ""  # the config table it owns, e.g. "[name]" in a config file

    def __init__(self, settings, seed: int = 0):
        self.settings, self.seed = settings, seed

    @classmethod
    def from_config(cls, cfg) -> "ModelTransform | None":
        """The transform of run config `cfg` (spmd.assembly.config.Config), or None when its table
        leaves it off."""
        settings = getattr(cfg, cls.table)
        return cls(settings, cfg.train.seed) if settings.enabled else None

    @classmethod
    @abc.abstractmethod
    def from_record(cls, config: dict) -> "ModelTransform | None":
        """The transform a saved run's config record (config.json's "config") had, or None."""

    @abc.abstractmethod
    def family(self, family):
        """`family` whose model is built with the transform applied (spmd.core.family.ModelFamily)."""

    @abc.abstractmethod
    def adds(self, path: Path) -> bool:
        """Whether the parameter at `path` is one the transform added (it starts fresh from the
        seed; a run's `--init-from` weights are the model without them)."""

    def trains(self, path: Path) -> bool:
        """Whether the parameter at `path` trains; the others are frozen. Default: only what the
        transform added."""
        return self.adds(path)

    @property
    def frozen_dtype(self) -> str:
        """The dtype frozen parameters are held in ("": the model's parameter dtype)."""
        return ""

    @property
    def needs_key(self) -> bool:
        """Whether the train step draws random numbers for it (a key per microbatch)."""
        return False

    def step_context(self, key) -> contextlib.AbstractContextManager:
        """Entered while one microbatch of the train step traces, with its key (or None)."""
        return contextlib.nullcontext()

    def off(self, path: Path, value):
        """The value of the added parameter at `path` that turns the transform off (the model
        computes as if it were not there), or None where no such value exists."""
        return None

    @abc.abstractmethod
    def merged(self, params: Mapping) -> dict:
        """The model's parameters without the transform (for evaluation, sampling and export)."""

    @abc.abstractmethod
    def plain(self, cfg):
        """Run config `cfg` with this transform's table off: the config of `merged`'s model."""

    def check(self, plan) -> None:
        """Raise UserError for a sharding plan (spmd.parallel.sharding.ShardingPlan) it cannot run under."""


@functools.cache
def kinds() -> tuple[type[ModelTransform], ...]:
    """Every transform of the `spmd.transforms` package (found once per process)."""
    package = importlib.import_module(PACKAGE)
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        if isinstance(getattr(module, "TRANSFORM", None), type):
            found.append(module.TRANSFORM)
    return tuple(found)


def active(cfg) -> tuple[ModelTransform, ...]:
    """The transforms run config `cfg` turns on."""
    return tuple(t for t in (kind.from_config(cfg) for kind in kinds()) if t is not None)


def of_record(config: dict) -> tuple[ModelTransform, ...]:
    """The transforms a saved run had, from its config record."""
    return tuple(t for t in (kind.from_record(config) for kind in kinds()) if t is not None)


def plain(cfg, transforms=None):
    """Run config `cfg` without its transforms: the config of the merged model."""
    for t in active(cfg) if transforms is None else transforms:
        cfg = t.plain(cfg)
    return cfg


def merged(params: Mapping, transforms) -> dict:
    """The model's parameters without `transforms` (each folds or drops what it added)."""
    for t in reversed(tuple(transforms)):
        params = t.merged(params)
    return params


# --- the trainable/frozen seam the trainer sees ---------------------------------------------------


def split_tree(tree: Mapping, keep: Callable[[Path], bool]) -> tuple[dict, dict]:
    """(the leaves `keep` says yes to, the others): a parameter tree (or one shaped like it) in two
    disjoint halves, each with the nesting of the whole and without empty branches."""

    def part(node, path, want):
        if not isinstance(node, Mapping):
            return node if keep(path) == want else None
        out = {}
        for k, v in node.items():
            sub = part(v, (*path, k), want)
            if sub is not None and not (isinstance(sub, Mapping) and not sub):
                out[k] = sub
        return out

    return part(tree, (), True), part(tree, (), False)


def combine(first: Mapping, second: Mapping) -> dict:
    """The whole tree from two disjoint halves (no copies: the leaves are shared)."""
    out = dict(second)
    for k, v in first.items():
        out[k] = combine(v, out[k]) if isinstance(v, Mapping) and k in out else v
    return out


@dataclasses.dataclass(frozen=True)
class Partition:
    """What of a model trains. Without transforms that freeze anything, everything trains."""

    transforms: tuple[ModelTransform, ...] = ()

    @property
    def freezes(self) -> bool:
        return bool(self.transforms)

    def trains(self, path: Path) -> bool:
        return not self.transforms or any(t.trains(path) for t in self.transforms)

    def adds(self, path: Path) -> bool:
        return any(t.adds(path) for t in self.transforms)

    def split(self, tree: Mapping) -> tuple[dict, dict]:
        """(trained, frozen) halves of a parameter tree."""
        return split_tree(tree, self.trains) if self.freezes else (tree, {})

    def added(self, tree: Mapping) -> dict:
        """The parameters of a tree that the transforms added."""
        return split_tree(tree, self.adds)[0]

    def without_added(self, tree: Mapping) -> dict:
        """The tree without the parameters the transforms added: the model a run starts from."""
        return split_tree(tree, self.adds)[1] if self.freezes else tree

    def off(self, trained: Mapping):
        """`trained` (the trained half of a tree) with every transform turned off: with the frozen
        half, the model the run started from, without a copy of it (a preference objective's
        reference). None where a trained parameter has no such value (it is not one the
        transforms added, or its transform has no off state)."""
        import jax

        leaves, treedef = jax.tree_util.tree_flatten_with_path(trained)
        out = []
        for path, leaf in leaves:
            keys = tuple(getattr(k, "key", k) for k in path)
            owner = next((t for t in self.transforms if t.adds(keys)), None)
            value = None if owner is None else owner.off(keys, leaf)
            if value is None:
                return None
            out.append(value)
        return jax.tree_util.tree_unflatten(treedef, out)

    @property
    def frozen_dtype(self) -> str:
        dtypes = {t.frozen_dtype for t in self.transforms} - {""}
        return dtypes.pop() if len(dtypes) == 1 else ""

    @property
    def needs_key(self) -> bool:
        return any(t.needs_key for t in self.transforms)

    def step_context(self, key) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for t in self.transforms:
            stack.enter_context(t.step_context(key))
        return stack
