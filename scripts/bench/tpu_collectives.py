"""What the TPU compiler emits for one gather and one reduce-scatter: over a whole slice
or over part of it, on 2-D and 3-D tori. Compile only, from this CPU machine (libtpu: pip install
'.[tpu]').

    python scripts/bench/tpu_collectives.py [--cases v5p:4x4x4=64,v5p:4x4x4=4x16,...]

Each case is TOPOLOGY=MESH (a mesh of 1 or 2 axes over all the slice's chips); for every axis a
`shard_map` with `jax.lax.all_gather` and one with `jax.lax.psum_scatter` of a bf16 [4096, 14336]
(a llama-8b MLP matrix) are compiled, and the table gives the collective the compiled HLO runs
and its result shape. A gather or reduce-scatter that runs as an all-reduce sends twice the bytes
(spmd.analysis.explain.AS_ALL_REDUCE), whatever the sharding rules say.
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent))

DEFAULT = (
    "v5p:2x2x1=4,v5p:2x2x2=8,v5p:4x4x4=64,v5p:4x4x4=4x16,v5p:4x4x8=2x64,v5e:2x4=8,v5e:8x8=64,v5e:8x8=2x32"
)


def emitted(fn, arg, mesh) -> str:
    """The collectives of the compiled HLO as spmd.analysis.hlo reads them (the TPU compiler's
    all-reduce-scatter fusion is a reduce-scatter), with each result's dims."""
    import jax

    from spmd.analysis import hlo

    items = hlo.collectives(jax.jit(fn).lower(arg).compile().as_text(), mesh)
    ops = [f"{c.kind} {'x'.join(map(str, c.shapes[0]))}" for c in items]
    return ", ".join(dict.fromkeys(ops)) or "none"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.analysis import topology
    from spmd.core.errors import UserError

    print("| topology | mesh | group | whole slice | all_gather compiles to | psum_scatter compiles to |")
    print("|---|---|---:|---|---|---|")
    for case in args.cases.split(","):
        name, _, shape = case.partition("=")
        try:
            devices = topology.devices(name)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        dims = tuple(int(d) for d in shape.split("x"))
        names = ("a", "b")[: len(dims)]
        mesh = Mesh(mesh_utils.create_device_mesh(dims, devices, allow_split_physical_axes=True), names)
        for ax in names:
            split = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16, sharding=NamedSharding(mesh, P(ax)))
            whole = jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

            def gather(a, ax=ax):
                return jax.lax.all_gather(a, ax, axis=0, tiled=True) * 2

            def scatter(a, ax=ax):
                return jax.lax.psum_scatter(a, ax, scatter_dimension=0, tiled=True)

            ag = jax.shard_map(gather, mesh=mesh, in_specs=P(ax), out_specs=P(), check_vma=False)
            rs = jax.shard_map(scatter, mesh=mesh, in_specs=P(), out_specs=P(ax), check_vma=False)
            print(
                f"| {name} | {shape} | {mesh.shape[ax]} | {'yes' if mesh.shape[ax] == len(devices) else 'no'} "
                f"| {emitted(ag, split, mesh)} | {emitted(rs, whole, mesh)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
