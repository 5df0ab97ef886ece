"""Measured choices for attention on accelerators: `tuned.toml` beside this file, written from
`scripts/gpu/gpu_check.py`'s sweep on a device and kept in the repository.

Each `[[attention]]` entry is one device kind (`jax.Device.device_kind`, e.g. "NVIDIA H200"),
compute dtype, head dim and sequence length, with the forward+backward TFLOP/s of each
implementation measured, the fastest of them, and the flash kernel's best block sizes (tiles,
Triton warps and pipeline stages). A lookup takes the entry of the same device kind, dtype and
head dim whose sequence length is nearest (in ratio); none is an answer too: not measured.
"""

import dataclasses
import functools
import math
import pathlib
import tomllib

TABLE = pathlib.Path(__file__).with_name("tuned.toml")


@dataclasses.dataclass(frozen=True)
class Measured:
    device_kind: str
    dtype: str
    head_dim: int
    seq_len: int
    fastest: str  # the implementation with the highest forward+backward TFLOP/s
    tflops: dict  # implementation -> forward+backward TFLOP/s
    blocks: dict  # the flash kernel's BlockSizes fields
    measured: str  # when and how

    def why(self) -> str:
        """e.g. "measured on NVIDIA H200 at T 8192, H 128: cudnn 464, pallas 267 TFLOP/s"."""
        figures = ", ".join(f"{k} {v:.0f}" for k, v in sorted(self.tflops.items(), key=lambda kv: -kv[1]))
        return f"measured on {self.device_kind} at T {self.seq_len}, H {self.head_dim}: {figures} TFLOP/s"


@functools.cache
def entries(path: pathlib.Path = TABLE) -> tuple[Measured, ...]:
    if not path.is_file():
        return ()
    doc = tomllib.loads(path.read_text())
    return tuple(Measured(**e) for e in doc.get("attention", []))


def lookup(device_kind: str, dtype: str, head_dim: int, seq_len: int, table=None) -> Measured | None:
    """The measurement nearest to this shape on this device kind, or None."""
    same = [
        e
        for e in (entries() if table is None else table)
        if e.device_kind == device_kind and e.dtype == dtype and e.head_dim == head_dim
    ]
    if not same:
        return None
    return min(same, key=lambda e: abs(math.log(e.seq_len / max(seq_len, 1))))


def to_toml(measured: list[Measured]) -> str:
    """`tuned.toml`'s text for these entries (what scripts/gpu/gpu_check.py writes)."""

    def value(v):
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, str):
            return '"' + v.replace('"', '\\"') + '"'
        return repr(v)

    out = ["\n".join(("# " + line).rstrip() for line in __doc__.strip().splitlines()) + "\n"]
    for e in measured:
        out.append("[[attention]]")
        out += [f"{f.name} = {value(getattr(e, f.name))}" for f in dataclasses.fields(e)]
        out.append("")
    return "\n".join(out)
