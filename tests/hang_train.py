"""spmd-train (its arguments) with failures injected, for the restart tests.

When a process is about to fetch the batch of step $HANG_STEP (0-based) and `$HANG_MARK.<process>`
does not exist yet, it creates the mark and blocks forever, as a wedged data read or a
deadlocked collective would. Process $DIE_PROCESS, about to fetch the batch of step $DIE_STEP,
kills itself with SIGKILL once (mark `$HANG_MARK.died`). A restarted attempt finds the marks and
runs normally.
"""

import os
import pathlib
import signal
import sys
import threading

from spmd.cli.train import main
from spmd.loop import train_loop as loop

PROCESS = os.environ.get("SPMD_PROCESS_ID", "0")
HANG_STEP = int(os.environ.get("HANG_STEP", -1))
MARK = pathlib.Path(f"{os.environ['HANG_MARK']}.{PROCESS}")
DIE_STEP, DIE_PROCESS = int(os.environ.get("DIE_STEP", -1)), os.environ.get("DIE_PROCESS", "")
DIED = pathlib.Path(f"{os.environ['HANG_MARK']}.died")


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
        if step == DIE_STEP and PROCESS == DIE_PROCESS and not DIED.exists():
            DIED.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.train_batch(step)


_init = loop.TrainLoop.__init__


def _hanging_init(self, step_fn, batches, *args, **kwargs):
    _init(self, step_fn, HangingBatches(batches), *args, **kwargs)


loop.TrainLoop.__init__ = _hanging_init

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
