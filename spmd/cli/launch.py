"""`spmd-launch`: run N processes of a command on this machine as one jax.distributed job (spmd.platform.launcher)."""

import argparse
import sys

from spmd.cli.common import Parser, run_main


def build_parser() -> argparse.ArgumentParser:
    from spmd.platform import launcher

    p = Parser(
        prog="spmd-launch",
        description=launcher.__doc__.split("\n\n")[0],
        epilog="example: spmd-launch --processes 2 --host-devices 4 -- spmd-train --config tiny --mesh fsdp=8",
    )
    p.add_argument("--processes", type=int, required=True, help="number of processes")
    # Its own dest: the devices are each child's, so the launcher itself never sets them up.
    p.add_argument(
        "--host-devices", dest="child_host_devices", type=int, help="simulated CPU devices per process"
    )
    p.add_argument("--port", type=int, help="coordinator port [a free one]")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the whole job up to N times when it fails (any exit code but 2, bad input), after "
        "a back-off of 2, 4, 8... s; spmd-train resumes from its latest committed checkpoint [0]",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show the collective library's connection lines ([Gloo] ...)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run in every process")
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), run, argv)


def run(args) -> int:
    from spmd.core.errors import UserError
    from spmd.platform.launcher import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UserError("give the command to run after --, e.g. spmd-launch --processes 2 -- spmd-train ...")
    if args.processes < 1:
        raise UserError(f"--processes must be positive, got {args.processes}")
    if args.port is not None:
        import socket

        if not 1 <= args.port <= 65535:
            raise UserError(f"--port must be between 1 and 65535, got {args.port}")
        with socket.socket() as s:  # a busy port would make process 0's coordinator abort
            try:
                s.bind(("127.0.0.1", args.port))
            except OSError as e:
                raise UserError(
                    f"--port {args.port} is not free ({e.strerror}); pick another or leave it out"
                ) from None
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return launch(
        args.processes, command, args.child_host_devices, args.port, args.max_restarts, verbose=args.verbose
    )


if __name__ == "__main__":
    sys.exit(main())
