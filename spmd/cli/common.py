"""What every command shares: the argument parser, simulated host devices, and the one wrapper that turns bad input (UserError) into a single `error:` line and exit code 2."""

import argparse
import os
import sys


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error:` line and exit 2, like every other bad input."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def env_host_devices() -> int | None:
    """$SPMD_HOST_DEVICES (set by spmd-launch for each process), or None when it is unset."""
    value = os.environ.get("SPMD_HOST_DEVICES")
    return None if value is None else host_devices_count(value, "$SPMD_HOST_DEVICES")


# Simulated CPU devices one process can hold: XLA builds a client per device, and far more than
# this takes minutes before anything is said.
MAX_HOST_DEVICES = 4096


def host_devices_count(text: str, source: str = "") -> int:
    """A device count as given on the command line or in the environment: a positive integer, at
    most MAX_HOST_DEVICES."""
    where = f" (from {source})" if source else ""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive integer is needed{where}, got {text!r}")
    if int(text) > MAX_HOST_DEVICES:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_HOST_DEVICES} simulated devices fit one process{where}, got {text}; plan bigger "
            f"meshes with spmd-plan --devices or spmd-dryrun --topology"
        )
    return int(text)


def add_host_devices(
    p: argparse.ArgumentParser, help: str = "simulate N CPU devices", from_env: bool = False
) -> None:
    """--host-devices; `from_env`: defaults to $SPMD_HOST_DEVICES (commands spmd-launch runs)."""
    if from_env:
        # A string default goes through `type` too: a bad $SPMD_HOST_DEVICES is a usage error.
        p.add_argument(
            "--host-devices",
            type=lambda text: host_devices_count(text, "--host-devices or $SPMD_HOST_DEVICES"),
            default=os.environ.get("SPMD_HOST_DEVICES"),
            help=f"{help} [$SPMD_HOST_DEVICES]",
        )
    else:
        p.add_argument("--host-devices", type=host_devices_count, help=help)


def add_run_flags(
    p: argparse.ArgumentParser, config_default: str | None = "small", config_note: str = ""
) -> None:
    """--config, --mesh, --rules and --set, with the presets that exist named in their help.
    `config_note`: what the default means where it is None (spmd-train: small, or --init-from's)."""
    from spmd.core import presets
    from spmd.core.mesh import MESH_AXES

    configs = ", ".join(presets.names(presets.folder("configs")))
    rules = ", ".join(presets.names(presets.folder("sharding_rules")))
    p.add_argument(
        "--config",
        default=config_default,
        help=f"config preset ({configs}) or a .toml path [{config_note or config_default}]",
    )
    p.add_argument(
        "--mesh",
        default="fsdp=-1",
        help=f"mesh shape over the axes {', '.join(MESH_AXES)} (unnamed axes are 1; one size may be -1 = "
        f"what is left), e.g. data=2,fsdp=2,tensor=2; multiplies to the device count [fsdp=-1]",
    )
    p.add_argument("--rules", default="fsdp", help=f"sharding rules preset ({rules}) or a .toml path [fsdp]")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optimizer.learning_rate=1e-3 (repeatable; spmd-train --list-keys)",
    )


TRUST_UNVERIFIED_HELP = (
    "read a checkpoint whose metadata lacks its digest or checksums (every save writes them: one "
    "without was damaged or edited); what it holds is then not checked"
)


def add_trust_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-unverified", action="store_true", help=TRUST_UNVERIFIED_HELP)


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Which checkpoint to load and onto which mesh (spmd-eval, spmd-sample)."""
    p.add_argument(
        "--run-dir", required=True, help="a training run directory (or a checkpoints dir, or one step)"
    )
    p.add_argument("--step", type=int, help="a committed step [latest]")
    p.add_argument("--mesh", default="fsdp=-1", help="mesh to load onto [fsdp=-1]")
    p.add_argument("--rules", help="sharding rules [the run's own]")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the run's config, e.g. --set model.dtype=float32 (repeatable)",
    )
    add_trust_flag(p)
    add_host_devices(p)


def set_host_devices(n: int) -> None:
    """Use the CPU backend with `n` simulated devices. Must run before JAX initialises a backend."""
    from spmd.core.errors import UserError

    if n < 1:
        raise UserError(f"--host-devices must be positive, got {n}")
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise UserError("--host-devices must take effect before JAX starts; it was given too late")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def set_host_platform() -> None:
    """Run JAX itself on the CPU (for compile-only devices of another platform, spmd.analysis.topology):
    where libtpu is installed JAX would otherwise look for TPU chips and warn that there are none."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def skip_absent_accelerators() -> None:
    """With no platform named and no TPU chip or GPU visible (spmd.platform.hostmem.cpu_host: the PCI bus and
    device files, as JAX looks), name the CPU for JAX. Where libtpu is installed (the `tpu` extra)
    JAX would otherwise initialise it on every start, and libtpu writes five lines about the TPU it
    cannot find to stderr before JAX falls back to the CPU, burying a command's own output and its
    one `error:` line. Nothing changes where a device is visible. Set in the environment before JAX
    is imported (child processes decide alike), else in JAX's config before it starts a backend."""
    from spmd.platform import hostmem

    if "jax" in sys.modules:
        import jax

        if not jax.config.jax_platforms and hostmem.cpu_host(platforms=""):
            set_host_platform()  # a no-op once a backend has started
    elif not os.environ.get("JAX_PLATFORMS") and hostmem.cpu_host(platforms=""):
        os.environ["JAX_PLATFORMS"] = "cpu"  # child processes decide alike
        # Looking imported JAX, which read the environment then: tell its config too.
        set_host_platform()


def exit_now(code: int) -> int:
    """Exit without running interpreter shutdown: Orbax/TensorStore worker threads that are still
    failing on a broken checkpoint would otherwise print tracebacks after our one `error:` line."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(parser: argparse.ArgumentParser, body, argv=None) -> int:
    """Parse `argv`, apply --host-devices (when the command has it), run `body(args)`; bad input
    anywhere becomes one `error:` line on stderr and exit code 2."""
    args = parser.parse_args(argv)
    from spmd.core.errors import UserError, report

    try:
        if getattr(args, "trust_unverified", False):
            from spmd.io import checkpoint

            checkpoint.trust_unverified()
        if getattr(args, "host_devices", None) is not None:
            set_host_devices(args.host_devices)
        else:
            skip_absent_accelerators()
        return body(args)
    except UserError as e:
        report(e)
        return exit_now(getattr(e, "exit_code", 2))
