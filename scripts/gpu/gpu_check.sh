#!/usr/bin/env bash
# The prepared GPU check, on the GPU machine from the repository root (see scripts/gpu/gpu_check.py and
# ../shared/notes/gpu.md): the carried wheels (.whl/, downloaded here with scripts/gpu/gpu_wheels.sh)
# go into /tmp/site over the machine's own packages, then the check runs. Arguments pass through.
set -euo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 scripts/gpu/gpu_check.py "$@"
