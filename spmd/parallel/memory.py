"""Host memory (memory kind `pinned_host`) for the two offload levers: the optimizer state kept on
the host between steps (`optimizer.offload`) and remat residuals saved to the host
(`model.remat = offload_dots`).

What a backend does with host memory is asked of it, not assumed from its name:

- arrays and a compiled program's arguments and results can live in `pinned_host` where the
  devices list it among their memories. XLA:CPU does (its "device" and "host" memory are the same
  RAM, so nothing is saved there, but the layout is the one a TPU or GPU would run);
- moving data between memories *inside* a program (what the remat policy needs) is lowered by JAX
  only for TPU and GPU; on XLA:CPU it compiles to nothing, so asking for it there would be a silent
  no-op. `moves_inside_programs` lowers a two-line probe and looks for the annotation that places data on the host.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spmd.core.errors import UserError
from spmd.core.mesh import platform_of

HOST = "pinned_host"


def host_memory_kinds(mesh) -> bool:
    """Whether the mesh's devices have a `pinned_host` memory."""
    device = mesh.devices.flat[0]
    return HOST in {m.kind for m in device.addressable_memories()}


@functools.cache
def _probe(mesh) -> bool:
    on_device = NamedSharding(mesh, PartitionSpec())
    on_host = on_device.with_memory_kind(HOST)
    program = jax.jit(lambda x: jax.device_put(jax.device_put(x, on_host) * 2, on_device))
    text = program.lower(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=on_device)).as_text()
    # The annotation that moves the intermediate to the host (an annotation placing the result on
    # the device may appear on its own and moves nothing).
    return f'_xla_buffer_placement = "{HOST}"' in text


def moves_inside_programs(mesh) -> bool:
    """Whether a program compiled for the mesh's devices moves data to host memory and back
    mid-program (JAX emits the placement annotation XLA needs), as host-offloaded remat does."""
    return host_memory_kinds(mesh) and _probe(mesh)


def check(cfg, mesh) -> None:
    """UserError for an offload the backend of `mesh` cannot do, naming what to change."""
    platform = platform_of(mesh)
    if cfg.optimizer.offload and not host_memory_kinds(mesh):
        raise UserError(
            f"optimizer.offload = true needs host memory (memory kind {HOST}), which the {platform} "
            "backend's devices do not have; set optimizer.offload = false"
        )
    if cfg.model.remat == "offload_dots" and not moves_inside_programs(mesh):
        raise UserError(
            f"model.remat = offload_dots needs a backend that moves activations to host memory inside "
            f"a program; JAX compiles that move to nothing on {platform} (it is lowered for TPU and GPU "
            "only), so it would silently save them on the device; use model.remat = save_dots or full"
        )


def host_shardings(tree):
    """The same shardings, in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), tree)
