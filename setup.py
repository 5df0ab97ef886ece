"""The wheel's layout: one top-level import name, `spmd`. The repository's models/ and kernels/
folders install as spmd.models and spmd.kernels (a generic `models` or `kernels` beside other
packages would shadow theirs: Hugging Face's kernel hub is `kernels`), the preset folders configs/
and sharding_rules/ as spmd.configs and spmd.sharding_rules. Every package below those folders is
found here, so a new model family's folder needs no entry. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = {"spmd": "spmd", "spmd.models": "models", "spmd.kernels": "kernels"}
PRESETS = {"spmd.configs": "configs", "spmd.sharding_rules": "sharding_rules"}

packages = [
    f"{name}.{sub}" if sub else name
    for name, folder in FOLDERS.items()
    for sub in ["", *find_packages(folder)]
]
setup(
    packages=[*packages, *PRESETS],
    package_dir={**FOLDERS, **PRESETS},
    # tuned.toml: the measured attention choices (spmd.kernels.tuning)
    package_data={name: ["*.toml"] for name in [*PRESETS, "spmd.kernels"]},
)
