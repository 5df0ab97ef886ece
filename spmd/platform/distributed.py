"""Joining a multi-process job with JAX's own runtime (`jax.distributed`), with bounded waits.

Where the job comes from, in order: the flags `--coordinator HOST:PORT --num-processes N
--process-id I`; the same in the environment (`SPMD_COORDINATOR`, `SPMD_NUM_PROCESSES`,
`SPMD_PROCESS_ID`, set by `spmd-launch`); a cluster JAX detects itself (SLURM with more than one
task, a multi-host TPU slice); else a plain single process.
"""

import os

from spmd.core.errors import UserError

ENV = {
    "coordinator": "SPMD_COORDINATOR",
    "num_processes": "SPMD_NUM_PROCESSES",
    "process_id": "SPMD_PROCESS_ID",
}


def add_flags(p) -> None:
    g = p.add_argument_group("multi-process (see docs/multihost.md)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service [$SPMD_COORDINATOR]")
    g.add_argument("--num-processes", type=int, help="processes in the job [$SPMD_NUM_PROCESSES]")
    g.add_argument("--process-id", type=int, help="this process's index, 0..N-1 [$SPMD_PROCESS_ID]")
    g.add_argument(
        "--init-timeout",
        type=int,
        default=60,
        help="seconds to wait for every process to join before failing [60]",
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="seconds without a heartbeat after which a vanished process fails the job [30]",
    )


def _cluster_detected() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return True
    return "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ["TPU_WORKER_HOSTNAMES"]


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    init_timeout: int = 60,
    heartbeat_timeout: int = 30,
    *,
    diverging_collectives: bool = False,
) -> None:
    """Join the job (see module doc); call before anything asks JAX for devices. Unset arguments
    come from the environment, as `add_flags`' flags do. `diverging_collectives`: the run's devices
    reach different collectives at once (a pipeline whose stages diverge), so a plain single
    process still starts JAX's runtime, as a job of one: on CPU that is what gives it the gloo
    collectives, which handle that (`collectives_may_diverge`)."""
    import jax

    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    n = num_processes if num_processes is not None else _env_int("num_processes")
    i = process_id if process_id is not None else _env_int("process_id")
    timeouts = {"initialization_timeout": init_timeout, "heartbeat_timeout_seconds": heartbeat_timeout}
    if coordinator is None and n is None and i is None:
        if _cluster_detected():
            _join(lambda: jax.distributed.initialize(**timeouts), "the cluster JAX detected", init_timeout)
        elif diverging_collectives:
            address = f"127.0.0.1:{_free_port()}"
            _join(
                lambda: jax.distributed.initialize(
                    coordinator_address=address, num_processes=1, process_id=0, **timeouts
                ),
                f"a job of one process on {address}",
                init_timeout,
            )
        return
    if coordinator is None or n is None or i is None:
        raise UserError(
            "a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and --process-id I"
        )
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    if n < 1:
        raise UserError(f"--num-processes must be positive, got {n}")
    if not 0 <= i < n:
        raise UserError(f"--process-id {i} is out of range for {n} processes (0..{n - 1})")
    if init_timeout < 1 or heartbeat_timeout < 1:
        raise UserError("--init-timeout and --heartbeat-timeout must be at least 1 second")
    if i != 0:
        _wait_for_coordinator(host, int(port), init_timeout)
    _join(
        lambda: jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=n, process_id=i, **timeouts
        ),
        f"coordinator {coordinator} as process {i} of {n}",
        init_timeout,
    )


def initialize_from_flags(args, *, diverging_collectives: bool = False) -> None:
    """`initialize` with the values of the flags `add_flags` added."""
    initialize(
        args.coordinator, args.num_processes, args.process_id, args.init_timeout, args.heartbeat_timeout,
        diverging_collectives=diverging_collectives,
    )  # fmt: skip


def collectives_may_diverge(devices) -> bool:
    """Whether a program may run different collectives on different devices at once on `devices`.
    XLA:CPU's in-process collectives (a single process without JAX's runtime) cannot: they
    rendezvous over every device of the program, so devices at different collectives wait for
    each other or swap the wrong values; its gloo collectives, which `jax.distributed` brings (a
    job of one process is enough), can, as accelerators' can."""
    import jax

    if len(devices) <= 1 or devices[0].platform != "cpu":
        return True
    return jax.distributed.is_initialized() and jax.config.jax_cpu_collectives_implementation == "gloo"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_coordinator(host: str, port: int, timeout: int) -> None:
    """JAX's runtime aborts the process (no exception) when it cannot register with the coordinator,
    so a process other than 0 first checks that the coordinator accepts connections."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"could not join the job: coordinator {host}:{port} did not accept a connection "
                    f"within {timeout}s ({e.strerror or e}); start process 0 there, or fix --coordinator"
                ) from None
            time.sleep(0.5)


def _env_int(key: str) -> int | None:
    value = os.environ.get(ENV[key])
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"${ENV[key]} must be an integer, got {value!r}") from None


def _join(init, what: str, timeout: int) -> None:
    try:
        init()
    except Exception as e:  # noqa: BLE001 — the runtime raises several kinds; all mean "could not join"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(
            f"could not join the job through {what} within {timeout}s ({first}); "
            f"check that every process was started and the address is reachable"
        ) from None
