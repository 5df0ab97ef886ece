"""Run N processes of a command on this machine as one jax.distributed job.

    spmd-launch --processes 2 --host-devices 4 -- spmd-train --config tiny --mesh fsdp=4,tensor=2 ...

Each process gets `SPMD_COORDINATOR` (loopback, a free port), `SPMD_NUM_PROCESSES`,
`SPMD_PROCESS_ID` and `SPMD_HOST_DEVICES`; its output lines are prefixed with `[i]`. As soon as
one process fails, the others are stopped (SIGTERM, then SIGKILL after a grace period) and the
launcher exits with that process's code. SIGTERM/SIGINT are forwarded to every process, so a
preempted job still saves its checkpoint.
"""

import os
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


def _pump(stream, prefix: str, out) -> None:
    for line in stream:
        out.write(f"{prefix}{line}")
        out.flush()


def launch(n: int, command: list[str], host_devices: int | None = None, port: int | None = None) -> int:
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
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[{i}] ", out), daemon=True)
            t.start()
            pumps.append(t)

    def forward(signum, frame):
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
