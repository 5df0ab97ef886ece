"""spmd-train (its arguments) with failures injected, for the restart tests.

When a process is about to fetch the batch of step $HANG_STEP (0-based) and `$HANG_MARK.<process>`
does not exist yet, it creates the mark and blocks forever, as a wedged data read or a
deadlocked collective would. Process $DIE_PROCESS, about to fetch the batch of step $DIE_STEP
(or of each step of a comma-separated list), kills itself with SIGKILL once there (mark
`$HANG_MARK.died-<step>`), first deleting `$DIE_WIPE` when set (its local checkpoint tier: a host
replaced). With `$DIE_IN_LOCAL_SAVE` = k, process $DIE_PROCESS kills
itself once (mark `$HANG_MARK.died-in-save`) in the middle of writing its local checkpoint of
step k (half its shards written).
A restarted attempt finds the marks and runs normally.
"""

import os
import pathlib
import shutil
import signal
import sys
import threading

from spmd.cli.train import main
from spmd.loop import train_loop as loop

PROCESS = os.environ.get("SPMD_PROCESS_ID", "0")
HANG_STEP = int(os.environ.get("HANG_STEP", -1))
MARK = pathlib.Path(f"{os.environ['HANG_MARK']}.{PROCESS}")
DIE_STEPS = {int(s) for s in os.environ.get("DIE_STEP", "").split(",") if s}
DIE_PROCESS = os.environ.get("DIE_PROCESS", "")
WIPE = os.environ.get("DIE_WIPE")
IN_SAVE = int(os.environ.get("DIE_IN_LOCAL_SAVE", -1))
DIED_IN_SAVE = pathlib.Path(f"{os.environ['HANG_MARK']}.died-in-save")


def hang_here():
    threading.Event().wait()


class HangingBatches:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def train_batch(self, step):
        if step == HANG_STEP and not MARK.exists():
            MARK.touch()
            hang_here()
        died = pathlib.Path(f"{os.environ['HANG_MARK']}.died-{step}")
        if step in DIE_STEPS and PROCESS == DIE_PROCESS and not died.exists():
            died.touch()
            if WIPE:
                # A replaced host loses everything it wrote: let its background local writes
                # finish first (else one could complete after the wipe and survive it).
                for tier in TIERS:
                    tier.wait()
                shutil.rmtree(WIPE, ignore_errors=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.train_batch(step)


_init = loop.TrainLoop.__init__


def _hanging_init(self, step_fn, batches, *args, **kwargs):
    _init(self, step_fn, HangingBatches(batches), *args, **kwargs)


loop.TrainLoop.__init__ = _hanging_init


def _dying_write(path, payload):
    if f"own/{IN_SAVE}.tmp-" in str(path) and PROCESS == DIE_PROCESS and not DIED_IN_SAVE.exists():
        DIED_IN_SAVE.touch()
        with open(path, "wb") as f:
            f.write(memoryview(payload)[: payload.size // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    _write_file(path, payload)


TIERS = []  # the run's local tier, once it has saved (for the wipe above)

if IN_SAVE >= 0 or WIPE:
    from spmd.io import local_tier

    if IN_SAVE >= 0:
        _write_file = local_tier.write_file
        local_tier.write_file = _dying_write
    _save = local_tier.LocalTier.save

    def _save_and_wait(self, step, *args):
        """Step k's write waits for itself: the kill lands while the loop is at step k (else the
        background write could still be running steps later)."""
        TIERS[:] = [self]
        _save(self, step, *args)
        if step == IN_SAVE:
            self.wait()

    local_tier.LocalTier.save = _save_and_wait

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
