"""spmd.hlo reads the TPU compiler's loops: their trip counts are in the loop conditions (no
`known_trip_count`), in s32 for JAX's scans and u32 for the SPMD partitioner's windowed-einsum
loops, which the compiler may widen to k steps per iteration. Text in the form libtpu 0.0.50 prints
(trimmed from a compiled llama-8b fsdp_tp step)."""

import numpy as np

from spmd import hlo

_PERMUTE = (
    "  %cp = (bf16[256,3584]{1,0}, bf16[256,3584]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start"
    "(%blk), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}"
)


def _module(counter_dtype: str, bound: int, step: int) -> str:
    t = counter_dtype
    return f"""HloModule m

%cond (p: (bf16[256,3584], {t}[])) -> pred[] {{
  %p = (bf16[256,3584]{{1,0}}, {t}[]) parameter(0)
  %bound = {t}[]{{:T(128)}} constant({bound})
  %i = {t}[]{{:T(128)}} get-tuple-element(%p), index=1
  ROOT %lt = pred[]{{:T(512)}} compare(%i, %bound), direction=LT
}}

%body (q: (bf16[256,3584], {t}[])) -> (bf16[256,3584], {t}[]) {{
  %q = (bf16[256,3584]{{1,0}}, {t}[]) parameter(0)
  %blk = bf16[256,3584]{{1,0}} get-tuple-element(%q), index=0
{_PERMUTE}
  %done = bf16[256,3584]{{1,0}} collective-permute-done(%cp)
  %j = {t}[]{{:T(128)}} get-tuple-element(%q), index=1
  %k = {t}[]{{:T(128)}} constant({step})
  %next = {t}[]{{:T(128)}} add(%j, %k)
  ROOT %out = (bf16[256,3584]{{1,0}}, {t}[]) tuple(%done, %next)
}}

ENTRY %main (x: bf16[256,3584]) -> (bf16[256,3584], {t}[]) {{
  %x = bf16[256,3584]{{1,0}} parameter(0)
  %zero = {t}[] constant(0)
  %init = (bf16[256,3584]{{1,0}}, {t}[]) tuple(%x, %zero)
  ROOT %loop = (bf16[256,3584]{{1,0}}, {t}[]) while(%init), condition=%cond, body=%body
}}
"""


class _Mesh:
    axis_names = ("fsdp",)
    devices = np.arange(4)


def test_loop_trip_counts_from_conditions_and_counter_steps():
    block = 256 * 3584 * 2
    for counter, bound, step, trips in [
        ("s32", 8, 1, 8),
        ("u32", 8, 1, 8),
        ("u32", 8, 2, 4),
        ("u32", 9, 2, 5),
    ]:
        (c,) = hlo.collectives(_module(counter, bound, step), _Mesh)
        assert (c.kind, c.axes, c.bytes, c.count) == ("collective-permute", ("fsdp",), block, trips)
