"""SPMD training stack: meshes, sharding rules, training loop, data and metrics.

The names a library user needs (docs/library.md), imported when first used:

    setup = spmd.assemble("tiny", "fsdp=8", "fsdp")      # config -> mesh -> rules -> plan -> trainer
    result = spmd.train(setup, pathlib.Path("runs/tiny"), hooks=[MyHook()])

`Setup` (what `assemble` returns), `ModelFamily` (a model family's contract), `Hook` and
`StepInfo` (a side job of the loop), `ModelTransform` (what changes a family before it is
parallelised, e.g. low-rank adapters), `UserError` (bad input, one line).

One import name: the repository's top-level `models/` and `kernels/` folders are the subpackages
`spmd.models` and `spmd.kernels`. They hold no `__init__.py`, so that run from the repository root
a plain `import models` or `import kernels` finds another installed package of that name (Hugging
Face's kernel hub is `kernels`), never these folders. An installed wheel lays them out inside
`spmd/`; an editable install or a source tree on PYTHONPATH gets them mapped here.
"""

import importlib as _importlib
import importlib.machinery as _machinery
import importlib.util as _util
import pathlib as _pathlib
import sys as _sys

PUBLIC = {
    "assemble": "spmd.assembly.setup",
    "Setup": "spmd.assembly.setup",
    "train": "spmd.run",
    "Result": "spmd.run",
    "ModelFamily": "spmd.core.family",
    "Hook": "spmd.loop.train_loop",
    "StepInfo": "spmd.loop.train_loop",
    "ModelTransform": "spmd.training.transform",
    "UserError": "spmd.core.errors",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name in PUBLIC:
        return getattr(_importlib.import_module(PUBLIC[name]), name)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")


def _map_source_folders() -> None:
    """In a source tree (or an editable install) the folders beside this package are
    `spmd.models` and `spmd.kernels`: packages without an `__init__.py`, their path the folder."""
    here = _pathlib.Path(__file__).resolve().parent
    for name in ("models", "kernels"):
        full, folder = f"{__name__}.{name}", here.parent / name
        if full in _sys.modules or (here / name).is_dir() or not folder.is_dir():
            continue
        spec = _machinery.ModuleSpec(full, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        module = _util.module_from_spec(spec)
        _sys.modules[full] = module
        globals()[name] = module


_map_source_folders()
