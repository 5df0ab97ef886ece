"""Run N processes of a command on this machine as one jax.distributed job.

    spmd-launch --processes 2 --host-devices 4 -- spmd-train --config tiny --mesh fsdp=4,tensor=2 ...

Each process gets `SPMD_COORDINATOR` (loopback, a free port), `SPMD_NUM_PROCESSES`,
`SPMD_PROCESS_ID` and `SPMD_HOST_DEVICES`; its output lines are prefixed with `[i]`, less the
collective library's connection lines (`[Gloo] Rank i is connected to n peer ranks`, one per
process and group: most of a short job's output) unless `verbose`. As soon as
one process fails, the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
launcher exits with that process's code (128 + N for a process killed by signal N). SIGTERM/SIGINT
are forwarded to every process, so a preempted job still saves its checkpoint.

With `max_restarts`, a job that fails with any code but 2 (bad input, which a rerun cannot fix) is
started again, all processes, after a back-off of 2, 4, 8, ... seconds (at most 60): the same
spmd-train command resumes from its latest committed checkpoint.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# gloo's line for every communicator each process joins, in the pieces it writes them in: threads
# joining at once interleave them at any piece ("[Gloo] Rank 3 is connected to 3[Gloo] Rank 2 is
# connected to  peer ranks. 3Expected ..."), and a number can end up on a line of its own.
CONNECTION_PIECES = re.compile(
    r"\[Gloo\]|Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d+|\s+"
)


def pump(stream, prefix: str, out, verbose: bool = False) -> None:
    after_gloo = False  # the previous line was gloo's: a bare number now is the rest of it
    for line in stream:
        gloo = "[Gloo]" in line or "is connected to" in line or "peer ranks" in line
        debris = not CONNECTION_PIECES.sub("", line) and (gloo or after_gloo and line.strip().isdigit())
        after_gloo = gloo
        if verbose or not debris:
            out.write(f"{prefix}{line}")
            out.flush()


INPUT_ERROR = 2


def launch(
    n: int,
    command: list[str],
    host_devices: int | None = None,
    port: int | None = None,
    max_restarts: int = 0,
    backoff_s: float = 2.0,
    verbose: bool = False,
) -> int:
    """Run the job; restart it up to `max_restarts` times after a failure other than bad input."""
    attempt = 0
    while True:
        code = _launch_once(n, command, host_devices, port, verbose)
        if code in (0, INPUT_ERROR) or attempt >= max_restarts or _stopping:
            return code
        attempt += 1
        wait = min(60.0, backoff_s * 2 ** (attempt - 1))
        print(
            f"spmd-launch: the job exited with {code}; restart {attempt} of {max_restarts} in {wait:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(wait)


_stopping = False  # a forwarded SIGTERM/SIGINT: the job is being stopped on purpose, no restart


def _launch_once(
    n: int, command: list[str], host_devices: int | None, port: int | None, verbose: bool
) -> int:
    port = port or free_port()
    procs, pumps = [], []
    for i in range(n):
        env = dict(
            os.environ,
            SPMD_COORDINATOR=f"127.0.0.1:{port}",
            SPMD_NUM_PROCESSES=str(n),
            SPMD_PROCESS_ID=str(i),
        )
        if host_devices is not None:
            env["SPMD_HOST_DEVICES"] = str(host_devices)
        try:
            proc = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:  # not found, not executable: before any process started, or after the first
            for p in procs:
                p.kill()
            from spmd.core.errors import UserError

            raise UserError(f"cannot run {command[0]!r}: {e.strerror}; give the command after --") from None
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=pump, args=(stream, f"[{i}] ", out, verbose), daemon=True)
            t.start()
            pumps.append(t)

    def forward(signum, frame):
        global _stopping
        _stopping = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)

    code = 0
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            if code < 0:  # killed by a signal: report it as a shell does
                code = 128 - code
            print(
                f"spmd-launch: process {i} exited with {code}; stopping the others",
                file=sys.stderr,
                flush=True,
            )
            _stop(procs)
            break
        if all(c == 0 for c in codes):
            break
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=5)
    return code


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
