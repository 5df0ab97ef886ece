"""The hang watchdog: a run whose steps stop finishing is stopped, with every thread's stack.

A deadlocked collective, a wedged filesystem under a save or a stuck data read shows up the same
way: the loop stops making progress and nothing fails. A daemon thread watches the time since
the loop last made progress (a step finished, or a hook such as eval or a save returned); past
the deadline it writes every Python thread's stack to stderr and to
`<run-dir>/hangs/step<N>.process<P>.txt` and exits with HUNG (4), which spmd-launch
--max-restarts treats as a failure to restart from the latest committed checkpoint.

The deadline is `train.step_timeout` seconds when set, else 10x the median of recent step times,
and at least 5 minutes (a step of a large model, a save, an eval). Before any step has been timed
it is 10x the train step's compile time, again at least 5 minutes, and so is the deadline of each
hook's first call whatever the setting: the first eval compiles its step and the first save its
checksum program, seconds that a step_timeout sized to the steps does not cover (as torchtitan
gives the first iteration its own, longer timeout).
"""

import faulthandler
import os
import pathlib
import statistics
import sys
import threading
import time

HUNG = 4  # exit code; spmd-launch restarts it (2, bad input, it does not)
FLOOR_S = 300.0
FACTOR = 10.0
WINDOW = 100  # recent step times the median is taken over


class Watchdog:
    def __init__(
        self,
        timeout: float,
        dump_dir: pathlib.Path | None,
        process: int = 0,
        compile_seconds: float = 0.0,
        floor: float = FLOOR_S,
    ):
        """`timeout` > 0: a fixed deadline in seconds; 0: automatic (see the module doc); < 0: off."""
        self.timeout, self.dump_dir, self.process = timeout, dump_dir, process
        self.first_deadline = max(floor, FACTOR * compile_seconds)
        self.floor = floor
        self.durations: list[float] = []
        self.step = 0  # the last step known to be finished
        self.last = time.monotonic()
        self.last_was_step = False
        self.first_call = False  # a hook is running for the first time: it may compile
        self._done = threading.Event()
        self._thread = None

    @property
    def enabled(self) -> bool:
        return self.timeout >= 0

    def deadline(self) -> float:
        if self.timeout > 0:
            steady = self.timeout
        elif not self.durations:
            steady = self.first_deadline
        else:
            steady = max(self.floor, FACTOR * statistics.median(self.durations[-WINDOW:]))
        return max(steady, self.first_deadline) if self.first_call else steady

    def hook_first_call(self) -> None:
        """A hook is about to run for the first time: until the next beat the deadline is at least
        the first deadline, as its first call compiles."""
        self.first_call = True

    def start(self, step: int) -> "Watchdog":
        self.step, self.last = step, time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="spmd-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        """Progress: `step` finished (its time since the last step counts towards the median), or,
        with no step, a hook returned."""
        now = time.monotonic()
        if step is not None:
            if self.last_was_step:
                self.durations.append(now - self.last)
                del self.durations[:-WINDOW]
            self.step = step
        self.last, self.last_was_step = now, step is not None
        self.first_call = False

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while True:
            deadline = self.deadline()
            if self._done.wait(min(1.0, max(0.05, deadline / 20))):
                return
            waited = time.monotonic() - self.last
            if waited > deadline:
                self._fire(waited, deadline)

    def _fire(self, waited: float, deadline: float) -> None:
        if self.first_call:
            how = "a hook's first call: 10x the compile time, at least 5 min"
        elif self.timeout > 0:
            how = "train.step_timeout"
        else:
            how = "10x the median step, at least 5 min"
        where = self._dump_path()
        message = (
            f"error: hang: no progress for {_secs(waited)} since step {self.step} finished (deadline {_secs(deadline)}, "
            f"{how}); every thread's stack follows{f' and is in {where}' if where else ''}; exiting with {HUNG} "
            f"(spmd-launch --max-restarts restarts from the latest checkpoint)\n"
        )
        os.write(2, message.encode())
        faulthandler.dump_traceback(2, all_threads=True)
        if where is not None:
            try:
                with open(where, "w") as f:
                    f.write(message)
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
            except OSError:
                pass
        sys.stderr.flush()
        os._exit(HUNG)

    def _dump_path(self) -> pathlib.Path | None:
        if self.dump_dir is None:
            return None
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return self.dump_dir / f"step{self.step}.process{self.process}.txt"


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
