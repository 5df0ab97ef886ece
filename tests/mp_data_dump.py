"""Run under spmd-launch: each process writes the rows of the global batch it loads (tests only)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from spmd.cli.common import env_host_devices, set_host_devices  # noqa: E402
from spmd.platform import distributed  # noqa: E402

out = pathlib.Path(sys.argv[1])
set_host_devices(env_host_devices())
distributed.initialize()  # the job spmd-launch describes in the environment
from spmd.assembly.setup import assemble  # noqa: E402

batches = assemble("tiny", sys.argv[2], "fsdp", overrides=["train.global_batch_size=16"]).batches()
rows = batches.local_rows
for step in range(3):
    batch = batches.train_batch(step)
    local = np.concatenate(
        [
            np.asarray(s.data)
            for s in sorted(batch["inputs"].addressable_shards, key=lambda s: s.index[0].start or 0)
            if s.replica_id == 0
        ]
    )
    np.save(out / f"p{jax.process_index()}_s{step}.npy", local)
    np.save(out / f"p{jax.process_index()}_rows.npy", np.array([rows[0], rows[-1] + 1]))
