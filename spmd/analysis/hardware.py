"""Datasheet figures of the accelerators we know: the one table behind MFU (spmd.loop.metrics) and the
planner's roofline (spmd.assembly.planner).

Dense bf16 peak FLOP/s per device; link bandwidths in bytes/s per device, one direction: NVLink 4
450 GB/s, InfiniBand NDR 400 Gb/s = 50 GB/s per GPU; TPU v5p ICI ~ 4 x 100 GB/s, DCN ~ 25 GB/s per
chip. Chips without link figures serve MFU only; the planner takes overrides (--ici-gbps, ...).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    device_kinds: tuple[str, ...]  # any of them found (case-insensitively) in jax's `device.device_kind`
    peak_flops: float  # dense bf16, per device
    ici_bytes_per_s: float | None = None  # fast links inside a host or slice
    dcn_bytes_per_s: float | None = None  # links between hosts or slices
    hbm_bytes: float | None = None  # memory per chip
    # GPUs in one host (one NVLink domain): axes beyond it cross hosts (DCN); None for TPUs, whose
    # slices span hosts on ICI
    per_host: int | None = None


CHIPS = {
    "h100": Chip(("H100",), 989e12, 450e9, 50e9, per_host=8),
    "h200": Chip(("H200",), 989e12, 450e9, 50e9, per_host=8),
    "h800": Chip(("H800",), 989e12, per_host=8),
    "a100": Chip(("A100",), 312e12, 300e9, 25e9, per_host=8),
    "l4": Chip(("L4",), 121e12, per_host=8),
    # TPU datasheets (cloud.google.com/tpu/docs/v5e, v5p, v6e): HBM per chip; ICI one direction
    # per chip is half the bidirectional figure (v5e 400 GB/s, v6e 800 GB/s). v4's ICI figure is
    # not from its page (not at hand here): an estimate between v5e's and v5p's.
    "tpu-v4": Chip(("TPU v4",), 275e12, 300e9, 25e9, 32 * 2**30),
    "tpu-v5e": Chip(("TPU v5 lite", "TPU v5e"), 197e12, 200e9, 25e9, 16 * 2**30),
    # libtpu's compile-only v5p devices say just "TPU v5" (matched after "TPU v5 lite" above).
    "tpu-v5p": Chip(("TPU v5p", "TPU v5"), 459e12, 400e9, 25e9, 95 * 2**30),
    "tpu-v6e": Chip(("TPU v6 lite", "TPU v6e"), 918e12, 400e9, 25e9, 32 * 2**30),
    # Not a datasheet: a CPU host stands in for a device in dry-runs; MFU measures it instead.
    "cpu": Chip(("cpu",), 0.4e12, 10e9, 1e9),
}


def chip_for(device_kind: str) -> tuple[str, Chip] | None:
    """The table entry whose device kind appears in jax's `device_kind` string (e.g. 'NVIDIA H100
    80GB HBM3'), or None."""
    for name, chip in CHIPS.items():
        if name != "cpu" and any(kind.lower() in device_kind.lower() for kind in chip.device_kinds):
            return name, chip
    return None


def planner_chips() -> list[str]:
    """Chips with link bandwidths, which `spmd-plan --hardware` can rank without overrides."""
    return sorted(name for name, chip in CHIPS.items() if chip.ici_bytes_per_s is not None)


def cores_per_chip(devices) -> int:
    """JAX devices per chip: TPU v4/v5p topologies may list each of a chip's TensorCores as a
    device, which then gets that share of the chip's FLOP/s, bandwidth and HBM."""
    return 1 + max(getattr(d, "core_on_chip", 0) for d in devices)
