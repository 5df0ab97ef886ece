#!/usr/bin/env bash
# Download, on this host, the pure-Python wheels the GPU machine lacks (it has no registry) into the
# ignored .whl/ folder that a device run carries (../shared/notes/gpu.md). Versions: this venv's.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
pkgs=()
for name in grain array-record portpicker tensorboardX tomli-w flax optax orbax-checkpoint; do
  version=$($py -c "import importlib.metadata as m; print(m.version('$name'))")
  pkgs+=("$name==$version")
done
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pkgs[@]}"
ls .whl
