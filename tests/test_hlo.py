"""spmd.analysis.hlo reads the TPU compiler's loops: their trip counts are in the loop conditions (no
`known_trip_count`), in s32 for JAX's scans and u32 for the SPMD partitioner's windowed-einsum
loops, which the compiler may widen to k steps per iteration. Text in the form libtpu 0.0.50 prints
(trimmed from a compiled llama-8b fsdp_tp step)."""

import numpy as np

from spmd.analysis import hlo

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


# One all-gather as the TPU compiler's async collective fusion writes it (libtpu 0.0.50, trimmed
# from a compiled `tiny` fsdp step): a start fusion, a continuation overlapping it with a matmul,
# and a done fusion, each with a copy of the all-gather under the same channel id. Beside it, a
# plain all-gather.
_ASYNC = """HloModule m

%start (p0: bf16[64,512]) -> (bf16[64,512], bf16[256,512], u32[]) {
  %p0 = bf16[64,512]{1,0} parameter(0)
  %ag.1 = bf16[256,512]{1,0} all-gather(%p0), channel_id=72, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %cc.1 = (bf16[64,512]{1,0}, bf16[256,512]{1,0}, u32[]{:S(2)}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%continue (p1: bf16[64,512], p2: bf16[8,256], p3: bf16[256,512]) -> (bf16[8,512], bf16[256,512]) {
  %p1 = bf16[64,512]{1,0} parameter(0)
  %p2 = bf16[8,256]{1,0} parameter(1)
  %p3 = bf16[256,512]{1,0} parameter(2)
  %mm = bf16[8,512]{1,0} convolution(%p2, %p3), dim_labels=bf_io->bf
  %ag.2 = bf16[256,512]{1,0} all-gather(%p1), channel_id=72, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %t = (bf16[8,512]{1,0}, bf16[256,512]{1,0}) tuple(%mm, %ag.2)
}

%done (p4: bf16[64,512], p5: bf16[256,512]) -> bf16[256,512] {
  %p4 = bf16[64,512]{1,0} parameter(0)
  %p5 = bf16[256,512]{1,0} parameter(1)
  %ag.3 = bf16[256,512]{1,0} all-gather(%p4), channel_id=72, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %cc.2 = bf16[256,512]{1,0} custom-call(%p4, %p5, %ag.3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (w: bf16[64,512], x: bf16[8,256], y: bf16[64,512]) -> (bf16[256,512], bf16[256,512]) {
  %w = bf16[64,512]{1,0} parameter(0)
  %x = bf16[8,256]{1,0} parameter(1)
  %y = bf16[64,512]{1,0} parameter(2)
  %s = (bf16[64,512]{1,0}, bf16[256,512]{1,0}, u32[]{:S(2)}) fusion(%w), kind=kCustom, calls=%start
  %b = bf16[256,512]{1,0} get-tuple-element(%s), index=1
  %c = (bf16[8,512]{1,0}, bf16[256,512]{1,0}) fusion(%w, %x, %b), kind=kOutput, calls=%continue
  %cb = bf16[256,512]{1,0} get-tuple-element(%c), index=1
  %d = bf16[256,512]{1,0} fusion(%w, %cb), kind=kCustom, calls=%done
  %plain = bf16[256,512]{1,0} all-gather(%y), channel_id=73, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  ROOT %r = (bf16[256,512]{1,0}, bf16[256,512]{1,0}) tuple(%d, %plain)
}
"""


def test_an_async_collective_fusion_is_one_collective():
    """The three copies of an async all-gather are one collective (counted three times, the
    weights of a `tiny` fsdp step came out gathered three times over); the plain one counts too."""
    items = hlo.collectives(_ASYNC, _Mesh)
    assert [(c.kind, c.axes, c.bytes, c.count, c.computation) for c in items] == [
        ("all-gather", ("fsdp",), 256 * 512 * 2, 1, "start"),
        ("all-gather", ("fsdp",), 256 * 512 * 2, 1, "main"),
    ]


def test_a_conditional_branch_counts_at_the_share_of_runs_that_take_it():
    """A scan of 8 ticks whose matmul runs, under a named scope, in a `lax.cond` taken on 2 of
    them: the first branch (idle) alone counts nothing; the branch's share counts its 2 runs."""
    import jax
    import jax.numpy as jnp

    def f(x_NK, w_KM):
        def tick(acc_NM, t):
            def live(a):
                with jax.named_scope("tail"):
                    return a + x_NK @ w_KM

            return jax.lax.cond(t % 4 == 0, live, lambda a: a, acc_NM), None

        return jax.lax.scan(tick, jnp.zeros((16, 8)), jnp.arange(8))[0]

    text = jax.jit(f).lower(jnp.ones((16, 32)), jnp.ones((32, 8))).compile().as_text()
    one = 2 * 16 * 32 * 8
    assert hlo.matmul_flops(text) == 0
    assert hlo.matmul_flops(text, {"tail": 2 / 8}) == 2 * one
    assert hlo.matmul_flops(text, {"other": 1.0}) == 0
