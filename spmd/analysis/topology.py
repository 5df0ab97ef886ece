"""TPU topologies from a CPU machine: compile-only TPU devices from libtpu, for dry-runs with the
real TPU compiler (`spmd-dryrun --topology v5p:4x4x4`, `spmd-plan --topology ...`).

    jax.experimental.topologies.get_topology_desc("v5e:4x4", "tpu").devices

gives the chips of a named slice (no TPU needed, only the `libtpu` wheel: `pip install '.[tpu]'`).
A program jitted over a mesh of them is lowered and compiled for TPU (XLA's TPU passes: its
reduce-scatter creator, bf16 collectives, its memory assignment); nothing can run. MaxText's
`train_compile.py` does the same.
"""

import dataclasses
import importlib.util
import math
import os

from spmd.analysis import hardware
from spmd.core.errors import UserError

# Topology name prefix -> (hardware.CHIPS entry, how libtpu names the accelerator type, chips per
# accelerator-type count unit: v4 and v5p count TensorCores, two per chip).
GENERATIONS = {
    "v4": ("tpu-v4", "v4-{}", 2),
    "v5e": ("tpu-v5e", "v5litepod-{}", 1),
    "v5p": ("tpu-v5p", "v5p-{}", 2),
    "v6e": ("tpu-v6e", "v6e-{}", 1),
}
EXAMPLES = "v4:2x2x2, v5e:4x4, v5e:16x16, v5p:2x2x1, v5p:4x4x4, v5p:8x8x8, v6e:8x8"

# The slices each generation is built as (Cloud TPU's documented shapes; MaxText declares the same
# per slice in src/MaxText/accelerator_to_spec_map.py for its compiles). 3-D generations (v4, v5p,
# one megacore device per chip): 2x2x1, 2x2x2, 2x2x4 and 2x4x4 are open grids; from 4x4x4 up every
# side is a multiple of 4, given as A <= B <= C, and every side wraps around (optical switches
# close each ring), up to the pod. 2-D generations (v5e, v6e): 1x1 to 16x16; a side of 16 wraps.
# Asked for without its wraparound, a slice is an open grid to the compiler, which then gathers over
# the whole of it by all-reducing zero-padded shards (twice the bytes) where the torus all-gathers.
SMALL_3D = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
SHAPES_2D = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
POD_CHIPS = {"v4": 4096, "v5p": 8960}


@dataclasses.dataclass(frozen=True)
class Slice:
    """How libtpu is asked for one slice: its shape, chip configuration (`megacore`: a chip's two
    TensorCores are one device), the chips each host holds along each side, and which sides wrap."""

    generation: str
    dims: tuple[int, ...]
    chip_config: str
    host_bounds: tuple[int, int, int]
    wrap: tuple[bool, bool, bool]

    @property
    def name(self) -> str:
        return f"{self.generation}:{'x'.join(map(str, self.dims))}"


def parse(name: str) -> tuple[str, tuple[int, ...]]:
    """'v5e:4x4' -> ('v5e', (4, 4)); UserError for anything else."""
    generation, _, shape = name.partition(":")
    try:
        dims = tuple(int(d) for d in shape.split("x"))
    except ValueError:
        dims = ()
    if generation not in GENERATIONS or not dims or min(dims) < 1:
        raise UserError(
            f"--topology {name!r} is not a TPU topology; give GENERATION:SHAPE with GENERATION one of "
            f"{', '.join(GENERATIONS)}, e.g. {EXAMPLES}"
        )
    return generation, dims


def real_shapes(generation: str) -> list[tuple[int, ...]]:
    """Every slice shape of `generation` (SMALL_3D, SHAPES_2D above), smallest first."""
    if generation not in POD_CHIPS:
        return list(SHAPES_2D)
    top = POD_CHIPS[generation]
    big = [
        (a, b, c)
        for a in range(4, top + 1, 4)
        for b in range(a, top // (a * a) + 1, 4)
        for c in range(b, top // (a * b) + 1, 4)
    ]
    return list(SMALL_3D) + sorted(big, key=lambda d: (math.prod(d), d))


def slice_of(name: str) -> Slice:
    """The slice `name` names ('v5p:4x4x4'); UserError naming the nearest real slices if there is
    no such slice."""
    generation, dims = parse(name)
    shapes = real_shapes(generation)
    if dims not in shapes:
        chips = math.prod(dims)
        near = sorted(shapes, key=lambda d: (abs(math.log(math.prod(d) / chips)), max(d) / min(d), d))[:3]
        raise UserError(
            f"--topology {name!r} is not a {generation} slice; the nearest are "
            f"{', '.join(generation + ':' + 'x'.join(map(str, d)) for d in sorted(near, key=math.prod))}"
        )
    three_d = generation in POD_CHIPS
    if three_d:
        wrap = (dims[0] >= 4,) * 3
    else:
        wrap = (dims[0] == 16, dims[1] == 16, False)
    return Slice(
        generation=generation,
        dims=dims,
        chip_config="megacore" if three_d else "default",
        host_bounds=(1, 1, 1) if dims == (1, 1) else (2, 2, 1),
        wrap=wrap,
    )


def chip(name: str) -> hardware.Chip:
    return hardware.CHIPS[GENERATIONS[parse(name)[0]][0]]


def devices(name: str, num_slices: int = 1, over_hbm: bool = False) -> list:
    """The compile-only devices of `num_slices` slices of topology `name` (slice_index tells them
    apart). UserError without libtpu, for an unknown topology, or a shape libtpu rejects.

    `over_hbm`: the TPU compiler compiles steps that do not fit the chip's HBM instead of refusing
    them (libtpu's --xla_tpu_no_crash_on_oom; read when libtpu loads, i.e. by the process's first
    call)."""
    spec = slice_of(name)
    generation, dims = spec.generation, spec.dims
    if num_slices < 1:
        raise UserError(f"--num-slices must be positive, got {num_slices}")
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(
            "--topology needs libtpu, the TPU compiler (about 640 MB): pip install '.[tpu]' "
            "(or pip install 'jax[tpu]==<this jax version>')"
        )
    # libtpu looks for the TPU VM it runs on and warns at length when there is none; say what we
    # compile for instead (a real TPU VM's own settings win).
    _, accelerator, per_chip = GENERATIONS[generation]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator.format(math.prod(dims) * per_chip))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Compiling touches no chip, so several processes may load libtpu at once (by default the
    # second one fails on libtpu's lockfile).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if over_hbm:
        os.environ["LIBTPU_INIT_ARGS"] = (
            f"{os.environ.get('LIBTPU_INIT_ARGS', '')} --xla_tpu_no_crash_on_oom=true".strip()
        )
    import jax
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            name,
            "tpu",
            chip_config_name=spec.chip_config,
            chips_per_host_bounds=spec.host_bounds,
            num_slices=num_slices,
            wrap=spec.wrap,
        )
    except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--topology {name!r}: libtpu rejects it ({first}); e.g. {EXAMPLES}") from None
    return list(topo.devices)


def hbm_per_device(name: str, devs) -> float | None:
    """HBM bytes per JAX device: the chip's, shared by its TensorCores where each is a device."""
    hbm = chip(name).hbm_bytes
    if hbm is None:
        return None
    return hbm / hardware.cores_per_chip(devs)
