"""The tick tables of the scheduled pipelines, whose stages diverge: which pass each stage runs in
each tick, nothing computed in the ticks a stage idles.

Each stage holds R chunks (layer groups); chunk r of stage s is the virtual stage v = r S + s, so a
microbatch's forward runs v = 0, 1, ..., R S - 1 (stage S - 1's chunk r hands it to stage 0's chunk
r + 1) and its backward the other way. Every stage runs its forwards in one order — microbatches
in groups of S, each group through chunk 0, then chunk 1, ...: the k-th is microbatch g S + j of
chunk r for k = g S R + r S + j — and its backwards in the same order with the chunks reversed
(`forward_order`, `backward_order`; with R = 1 both are the microbatches in order).

1F1B and interleaved 1F1B (whole backwards): each tick each stage runs F (a chunk's forward) or BW
(its whole backward, the input's and the weights' gradient in one pass), in a fixed sequence per
stage — (S - s - 1) 2 + (R - 1) S forwards first (S - s - 1 with R = 1), then a forward and a
backward in turn, then the backwards left — each as soon as what it waits for has arrived. With
passes alike a step takes 2 (R M + S - 1) ticks and each stage idles 2 (S - 1) of them: the bubble
(S - 1) / (R M + S - 1).

ZB-H1 and interleaved zero-bubble (split backwards): in the published ZB-H1 each stage runs, each
tick, one of three passes of one microbatch chunk: F, B (the input's gradient, which the previous
virtual stage waits for) or W (the weights' gradient, which nobody waits for), and W fills what
would be idle. Their table comes from a list scheduler over those unit passes, stage by stage each
tick: the oldest waiting W if `wlimit` weight passes wait; else B when its cotangent has arrived
(its forward ran here and the next virtual stage ran its B, or this is the last one); else F if its
input has arrived and fewer than `cap` chunks are between their F and their W here; else the oldest
waiting W; else nothing. The smallest `cap` and `wlimit` that reach 3 R M + S - 1 ticks are kept
(they bound what a stage holds: `wlimit` B's operands, the largest thing a stage keeps, which comes
out S at every shape tried, interleaved or not): each stage idles S - 1 ticks, a third of 1F1B's
3 (S - 1) pass-lengths. (W's bound goes before B: a scheduler that lets a ready B pass a full W
queue reaches the same ticks holding up to R S of them.)

Rings: what waits between two passes (a forward's residuals until its backward, B's operands for
W, arrived activations and cotangents) sits in a ring of slots; each value gets a slot free from
the tick it is made to the tick it is last read, the first free one in the order values are made
(interval colouring, which needs no more slots than are ever held at once), and a ring's length
is the most any stage uses.

GPipe and circular (`fill`): each stage runs all its forwards, then all its backwards (whole),
each as soon as its input has arrived — the fill-and-drain order of their lockstep forward loop,
microbatch by microbatch through chunk 0, then chunk 1, ... (`forward_order`), which needs only
M >= S — in 2 (R M + S - 1) ticks, 2 (S - 1) idle like 1F1B's, but holding the residuals of all
R M chunks at the end of the forwards, as autodiff of that loop does. What the table gains over
the lockstep loop is that an idle tick computes nothing.

Sends: what a stage's F makes reaches the next virtual stage, and what its B makes the previous
one, in the following tick, into the slot the table names (`arrives_forward`,
`arrives_backward`).

Legend: S stages, R chunks per stage, M microbatches, T ticks.
"""

import dataclasses
import functools

import numpy as np

# The passes, as the table writes them: BACKWARD is INPUT_GRAD and WEIGHT_GRAD in one (1F1B).
FORWARD, INPUT_GRAD, WEIGHT_GRAD, IDLE, BACKWARD = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Table:
    """kind[s, t], microbatch[s, t], chunk[s, t]: stage s's pass at tick t, its microbatch and
    chunk (0 when idle); forward_index / backward_index: that chunk's place in the stage's forward
    and backward order; the *_slot arrays: that chunk's slot in each ring."""

    kind: np.ndarray  # (S, T) int32
    microbatch: np.ndarray  # (S, T) int32
    chunk: np.ndarray  # (S, T) int32
    forward_index: np.ndarray  # (S, T) int32
    backward_index: np.ndarray  # (S, T) int32
    residual_slot: np.ndarray  # (S, T)
    saved_slot: np.ndarray  # (S, T)
    input_slot: np.ndarray  # (S, T)
    cotangent_slot: np.ndarray  # (S, T)
    arrives_forward: np.ndarray  # (S, T): the input slot of the activations arriving after tick t, or -1
    arrives_backward: np.ndarray  # (S, T): the cotangent slot of the cotangent arriving after tick t, or -1
    # Ring lengths (module doc).
    residual_slots: int  # the forward's residuals, from F to W (or BW)
    saved_slots: int  # what W reads from B, from B to W (0 when the backward is whole)
    input_slots: int  # activations arrived from the previous virtual stage, until F reads them
    cotangent_slots: int  # cotangents arrived (or, on the last virtual stage, from the loss), until B

    @property
    def ticks(self) -> int:
        return self.kind.shape[1]

    @property
    def passes(self) -> int:
        """Pass slots one microbatch chunk takes on a stage: F and BW, or F, B and W."""
        return 2 if (self.kind == BACKWARD).any() else 3

    def idle(self) -> int:
        """Idle ticks of each stage (all stages idle alike)."""
        return int((self.kind == IDLE).sum(axis=1).max())


def forward_order(S: int, M: int, R: int, fill: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each stage's k-th forward: with `fill` every microbatch through chunk
    0, then chunk 1, ..."""
    if fill:
        return [(k % M, k // M) for k in range(R * M)]
    out = []
    for k in range(R * M):
        g, within = divmod(k, S * R)
        r, j = divmod(within, S)
        out.append((g * S + j, r))
    return out


def backward_order(S: int, M: int, R: int, fill: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each stage's k-th backward (and weight pass)."""
    return [(m, R - 1 - r) for m, r in forward_order(S, M, R, fill)]


class _Run:
    """The passes run so far: done[kind][s, m, r] is the tick, or -1."""

    def __init__(self, S, M, R):
        self.S, self.R = S, R
        self.done = {k: np.full((S, M, R), -1, np.int64) for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)}

    def before(self, kind, s, m, r, t):
        return 0 <= self.done[kind][s, m, r] < t

    def input_ready(self, s, m, r, t):
        """F of (m, r) on stage s can run at tick t: the previous virtual stage's F ran."""
        if r == 0 and s == 0:
            return True
        return self.before(FORWARD, (s - 1) % self.S, m, r - (s == 0), t)

    def cotangent_ready(self, s, m, r, t):
        """B (or BW) of (m, r) on stage s can run at tick t."""
        if not self.before(FORWARD, s, m, r, t):
            return False
        if r == self.R - 1 and s == self.S - 1:
            return True
        return self.before(INPUT_GRAD, (s + 1) % self.S, m, r + (s == self.S - 1), t)


def _whole(S: int, M: int, R: int, fill: bool = False):
    """1F1B's (R = 1) and interleaved 1F1B's ticks, or with `fill` GPipe's and circular's: each
    stage's fixed sequence, each pass as soon as it can run."""
    fo, bo = forward_order(S, M, R, fill), backward_order(S, M, R, fill)
    run, n = _Run(S, M, R), R * M
    sequences = []
    for s in range(S):
        if fill:
            warm = n
        else:
            warm = min((S - s - 1) * 2 + (R - 1) * S if R > 1 else S - s - 1, n)
        seq = [(FORWARD, k) for k in range(warm)]
        f, b = warm, 0
        while f < n:
            seq += [(FORWARD, f), (BACKWARD, b)]
            f, b = f + 1, b + 1
        seq += [(BACKWARD, k) for k in range(b, n)]
        sequences.append(seq)
    at, t = [0] * S, 0
    while any(at[s] < 2 * n for s in range(S)):
        picks = []
        for s in range(S):
            if at[s] == 2 * n:
                continue
            kind, k = sequences[s][at[s]]
            m, r = (fo if kind == FORWARD else bo)[k]
            ok = run.input_ready(s, m, r, t) if kind == FORWARD else run.cotangent_ready(s, m, r, t)
            if ok:
                picks.append((s, kind, m, r))
        for s, kind, m, r in picks:
            for k in (INPUT_GRAD, WEIGHT_GRAD) if kind == BACKWARD else (kind,):
                run.done[k][s, m, r] = t
            at[s] += 1
        t += 1
        if t > 4 * (2 * n + S):  # a sequence waiting on a pass that never runs
            name = "fill-and-drain" if fill else "1F1B"
            raise ValueError(f"no {name} table for {S} stages, {R} chunks, {M} microbatches")
    return run.done, t


def _split(S: int, M: int, R: int, cap: int, wlimit: int):
    """ZB-H1's (R = 1) and interleaved zero-bubble's ticks from the list scheduler, or None if it
    stalls."""
    fo, bo = forward_order(S, M, R), backward_order(S, M, R)
    run, n = _Run(S, M, R), R * M
    count = {k: [0] * S for k in run.done}
    t = 0
    while min(count[WEIGHT_GRAD]) < n:
        picks = []
        for s in range(S):
            nf, nb, nw = count[FORWARD][s], count[INPUT_GRAD][s], count[WEIGHT_GRAD][s]
            ready_b = nb < n and run.cotangent_ready(s, *bo[nb], t)
            ready_f = nf < n and nf - nw < cap and run.input_ready(s, *fo[nf], t)
            if nb - nw >= wlimit:  # before B: no stage holds more than `wlimit` B's for W
                picks.append((s, WEIGHT_GRAD, *bo[nw]))
            elif ready_b:
                picks.append((s, INPUT_GRAD, *bo[nb]))
            elif ready_f:
                picks.append((s, FORWARD, *fo[nf]))
            elif nw < nb:
                picks.append((s, WEIGHT_GRAD, *bo[nw]))
        for s, kind, m, r in picks:
            run.done[kind][s, m, r] = t
            count[kind][s] += 1
        t += 1
        if t > 4 * (3 * n + S):
            return None
    return run.done, t


def _slots(held: list[tuple[tuple[int, int], int, int]]) -> dict[tuple[int, int], int]:
    """{value: slot} for values (key, start, end) each held from tick start to tick end (both
    counted): each takes the lowest slot free at its start, values taken in the order of their
    start; an interval colouring, so it uses as many slots as are ever held at once."""
    out, busy = {}, []  # busy: (end, slot) of the values still held
    for key, start, end in sorted(held, key=lambda v: (v[1], v[2])):
        busy = [(e, k) for e, k in busy if e >= start]
        taken = {k for _, k in busy}
        out[key] = slot = next(k for k in range(len(held) + 1) if k not in taken)
        busy.append((end, slot))
    return out


@functools.lru_cache(maxsize=64)
def table(S: int, M: int, split: bool = True, R: int = 1, fill: bool = False) -> Table:
    """The table for S stages, R chunks each and M >= S microbatches (a multiple of S when R > 1,
    unless `fill`): zero-bubble (`split`) in 3 R M + S - 1 ticks, else 1F1B, or with `fill`
    GPipe / circular, in 2 (R M + S - 1)."""
    n = R * M
    if split and fill:
        raise ValueError("a fill-and-drain table runs whole backwards: split must be False")
    if split:
        target = 3 * n + S - 1
        tries = ((cap, wlimit) for cap in range(S, 2 * R * S + 3) for wlimit in range(1, R * S + 3))
        found = next((f for cap, w in tries if (f := _split(S, M, R, cap, w)) and f[1] == target), None)
        if found is None:
            raise ValueError(
                f"no zero-bubble table of {target} ticks for {S} stages, {R} chunks, {M} microbatches"
            )
    else:
        found = _whole(S, M, R, fill)
    done, T = found
    fo, bo = forward_order(S, M, R, fill), backward_order(S, M, R, fill)
    f_index = {mr: k for k, mr in enumerate(fo)}
    b_index = {mr: k for k, mr in enumerate(bo)}
    kind = np.full((S, T), IDLE, np.int32)
    microbatch, chunk, fwd_i, bwd_i = (np.zeros((S, T), np.int32) for _ in range(4))
    for k, when in done.items():
        for s in range(S):
            for (m, r), t in np.ndenumerate(when[s]):
                kind[s, t] = k if split or k == FORWARD else BACKWARD
                microbatch[s, t], chunk[s, t] = m, r
                fwd_i[s, t], bwd_i[s, t] = f_index[m, r], b_index[m, r]
    F, Bk, Wk = done[FORWARD], done[INPUT_GRAD], done[WEIGHT_GRAD]
    # Per stage: ((m, r), start, end) of what each ring holds; (stage, tick, (m, r)) of each send.
    inputs, cotangents = [[] for _ in range(S)], [[] for _ in range(S)]
    sent_forward, sent_backward = [], []
    for m in range(M):
        for r in range(R):
            for s in range(S):
                if r * S + s < R * S - 1:  # F's output goes to the next virtual stage
                    d, dr = (s + 1) % S, r + (s == S - 1)
                    inputs[d].append(((m, dr), F[s, m, r], F[d, m, dr]))
                    sent_forward.append((d, F[s, m, r], (m, dr)))
                else:  # the loss's cotangent, made in F
                    cotangents[s].append(((m, r), F[s, m, r], Bk[s, m, r]))
                if r * S + s > 0:  # B's output goes to the previous virtual stage
                    d, dr = (s - 1) % S, r - (s == 0)
                    cotangents[d].append(((m, dr), Bk[s, m, r], Bk[d, m, dr]))
                    sent_backward.append((d, Bk[s, m, r], (m, dr)))

    def held(start, end):
        return [
            [((m, r), start[s, m, r], end[s, m, r]) for m in range(M) for r in range(R)] for s in range(S)
        ]

    def ring(per_stage):
        """(S, T) the slot of each tick's chunk, and the ring's length."""
        slot_of = [_slots(values) for values in per_stage]
        at = np.zeros((S, T), np.int32)
        for s in range(S):
            for t in range(T):
                at[s, t] = slot_of[s].get((int(microbatch[s, t]), int(chunk[s, t])), 0)
        return at, slot_of, max([1, *(v + 1 for slots in slot_of for v in slots.values())])

    (res_at, _, K), (in_at, in_of, Ki), (cot_at, cot_of, Kc) = (
        ring(held(F, Wk)),
        ring(inputs),
        ring(cotangents),
    )
    saved_at, _, Kw = ring(held(Bk, Wk)) if split else (np.zeros((S, T), np.int32), None, 0)
    arrives_forward = np.full((S, T), -1, np.int32)
    arrives_backward = np.full((S, T), -1, np.int32)
    for d, t, mr in sent_forward:
        arrives_forward[d, t] = in_of[d][mr]
    for d, t, mr in sent_backward:
        arrives_backward[d, t] = cot_of[d][mr]
    return Table(
        kind=kind, microbatch=microbatch, chunk=chunk, forward_index=fwd_i, backward_index=bwd_i,
        residual_slot=res_at, saved_slot=saved_at, input_slot=in_at, cotangent_slot=cot_at,
        arrives_forward=arrives_forward, arrives_backward=arrives_backward,
        residual_slots=K, saved_slots=Kw, input_slots=Ki, cotangent_slots=Kc,
    )  # fmt: skip
