"""Device meshes from flags: `--mesh data=2,fsdp=2,tensor=2` and `--dcn-mesh data=2`.

The axis vocabulary is fixed so that every rules file, checkpoint and log speaks the same names.
Axes a flag does not name have size 1. Axes are `Auto` (GSPMD style): we annotate parameters and a
few activations, and XLA's partitioner propagates the rest.
"""

import math
from collections.abc import Mapping

from spmd.core.errors import UserError, closest

# JAX is imported where a mesh is built, not here: commands name the axes in their --help before
# JAX starts (the host heap is set up first: spmd/platform/hostmem.py).

# Order matters: later axes are innermost, i.e. neighbouring devices. Tensor parallelism talks the
# most per step, so it gets the fastest links; pipeline stages (one activation per microbatch
# to the next stage) and data parallelism the least, so `--dcn-mesh stage=2` puts stages across
# processes or slices.
MESH_AXES = ("stage", "data", "fsdp", "context", "expert", "tensor")


def parse_mesh(spec: str, flag: str = "--mesh") -> dict[str, int]:
    """'data=2,fsdp=-1' -> {'data': 2, 'fsdp': -1, ...} with every axis present (default 1)."""
    sizes = {axis: 1 for axis in MESH_AXES}
    seen = set()
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq:
            raise UserError(f"{flag} entry {part!r} must look like AXIS=SIZE, e.g. {flag} fsdp=8")
        if name not in MESH_AXES:
            raise UserError(
                f"unknown mesh axis {name!r} in {flag}{closest(name, MESH_AXES)}; "
                f"axes are {', '.join(MESH_AXES)}"
            )
        if name in seen:
            raise UserError(f"mesh axis {name!r} appears twice in {flag} {spec!r}")
        seen.add(name)
        try:
            size = int(value)
        except ValueError:
            raise UserError(f"{flag} size for {name!r} must be an integer, got {value!r}") from None
        if size == 0 or size < -1:
            raise UserError(f"{flag} size for {name!r} must be positive or -1 (fill), got {size}")
        sizes[name] = size
    if sum(1 for s in sizes.values() if s == -1) > 1:
        raise UserError(f"at most one {flag} axis may be -1 (fill), got {spec!r}")
    return sizes


def resolve_sizes(sizes: dict[str, int], n_devices: int, flag: str = "--mesh") -> dict[str, int]:
    """Fill a -1 axis and check that the product equals `n_devices`."""
    known = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    if fill:
        if n_devices % known:
            raise UserError(
                f"{flag}: cannot fill {fill[0]!r}: {n_devices} devices do not divide by the "
                f"other axes' product {known}"
            )
        sizes = {**sizes, fill[0]: n_devices // known}
    product = math.prod(sizes.values())
    if product != n_devices:
        named = format_mesh(sizes, empty="(all 1)")
        raise UserError(
            f"{flag} {named} has {product} devices but {n_devices} are available; make the "
            f"sizes multiply to {n_devices} (one size may be -1 to fill)"
        )
    return sizes


def format_mesh(sizes: Mapping[str, int], empty: str = "single device") -> str:
    """'fsdp=4,tensor=2': the axes of more than one device, in mesh order (`empty` if there are none)."""
    return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or empty


def format_axes(sizes: Mapping[str, int], axes) -> str:
    """'fsdp=2 x tensor=4': the mesh axes a dimension is split over, with their sizes."""
    return " x ".join(f"{a}={sizes[a]}" for a in axes)


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None (not split), an axis name, or a tuple of names."""
    if not entry:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def platform_of(mesh) -> str:
    """The platform a mesh's programs are compiled for ("cpu", "gpu", "tpu"; compile-only TPU
    devices in a dry-run say "tpu")."""
    return mesh.devices.flat[0].platform


def axes_size(sizes: Mapping[str, int], axes) -> int:
    """How many ways `axes` split a dimension: the product of their sizes (1 for no axes).
    `sizes` is a mesh's shape (`mesh.shape`) or any axis -> size mapping."""
    return math.prod(sizes[a] for a in axes)


def build_mesh(mesh: str = "", dcn_mesh: str = "", devices=None):
    """A Mesh over all global devices with every axis of MESH_AXES (size 1 where unnamed).

    Without `--dcn-mesh`, `--mesh` describes all global devices. With it, `--mesh` is the mesh
    inside one process (standing in for a slice, ICI links) and `--dcn-mesh` multiplies it across
    processes (DCN links): `--dcn-mesh data=2 --mesh fsdp=4` on 2 processes x 4 devices.
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    if not dcn_mesh:
        sizes = resolve_sizes(parse_mesh(mesh), len(devices))
        shape = tuple(sizes[a] for a in MESH_AXES)
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        # The DCN granules: TPU slices where the devices span several (spmd.analysis.topology's
        # --num-slices), else processes.
        slices = {getattr(d, "slice_index", 0) for d in devices}
        by_slice = len(slices) > 1
        n_granules = len(slices) if by_slice else len({d.process_index for d in devices})
        dcn = resolve_sizes(parse_mesh(dcn_mesh, "--dcn-mesh"), n_granules, "--dcn-mesh")
        ici = resolve_sizes(parse_mesh(mesh), len(devices) // n_granules, "--mesh")
        grid = mesh_utils.create_hybrid_device_mesh(
            [ici[a] for a in MESH_AXES],
            [dcn[a] for a in MESH_AXES],
            devices=devices,
            process_is_granule=not by_slice,
        )
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def split_over_hosts(sizes: Mapping[str, int], hosts: int) -> tuple[dict, dict, int]:
    """(the mesh across hosts, the mesh inside one, the hosts left over) of a layout on `hosts`
    hosts: the outermost axes (MESH_AXES order: data, then fsdp, ...) take the hosts' factors, each
    the largest it shares with the hosts still to place. Left over > 1: the hosts do not divide out
    of the axes in that order."""
    across, inside, remaining = {}, dict(sizes), hosts
    for axis in MESH_AXES:
        share = math.gcd(remaining, inside.get(axis, 1))
        if share > 1:
            across[axis], inside[axis], remaining = share, inside[axis] // share, remaining // share
    return across, inside, remaining
