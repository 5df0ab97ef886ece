"""SPMD training stack: meshes, sharding rules, training loop, data and metrics.

One import name: the repository's top-level `models/` and `kernels/` folders are the subpackages
`spmd.models` and `spmd.kernels`. An installed wheel (or an editable install) lays them out so
(pyproject's package-dir); a source tree run without installing (PYTHONPATH=the checkout) gets
them mapped here.
"""

import importlib.util as _util
import pathlib as _pathlib
import sys as _sys


def _map_source_folders() -> None:
    """In a source tree the folders beside this package are the ones meant (also where another
    checkout is installed in editable mode)."""
    here = _pathlib.Path(__file__).resolve().parent
    for name in ("models", "kernels"):
        full = f"{__name__}.{name}"
        init = here.parent / name / "__init__.py"
        if full in _sys.modules or (here / name).is_dir() or not init.is_file():
            continue
        spec = _util.spec_from_file_location(full, init, submodule_search_locations=[str(init.parent)])
        module = _util.module_from_spec(spec)
        _sys.modules[full] = module
        spec.loader.exec_module(module)
        globals()[name] = module


_map_source_folders()
