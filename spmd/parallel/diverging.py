"""The tick tables of the schedules whose stages diverge (1F1B, ZB-H1): which pass each stage runs
in each tick, nothing computed in the ticks a stage idles.

1F1B: each tick each stage runs F (a microbatch's forward) or BW (its whole backward, the input's
and the weights' gradient in one pass). A list scheduler, stage by stage each tick: BW when the
microbatch's cotangent has arrived (the next stage ran its BW, or this is the last stage and its
forward ran); else F if its input has arrived and fewer than `cap` microbatches are between their F
and their BW here; else nothing. With passes alike a step takes 2 (M + S - 1) ticks and each stage
idles 2 (S - 1) of them: the bubble (S - 1) / (M + S - 1).

ZB-H1: in the published ZB-H1 each stage runs, each tick, one of three passes of one microbatch: F (the
forward), B (the input's gradient, which the previous stage waits for) or W (the weights' gradient,
which nobody waits for), and W fills what would be idle. With the three alike, a step takes 3 M +
S - 1 ticks and each stage idles S - 1 of them, a third of 1F1B's 3 (S - 1).

Its table comes from a list scheduler over those unit passes, stage by stage each tick: B when the
microbatch's cotangent has arrived (its forward ran here and the next stage ran its B, or this is
the last stage); else W if `wlimit` weight passes wait; else F if its input has arrived and fewer
than `cap` microbatches are between their F and their W here; else the oldest waiting W; else
nothing. The smallest `cap` and `wlimit` that reach 3 M + S - 1 ticks are kept (they bound what a
stage holds). F, B and W each run in microbatch order on every stage, so what waits between two
passes is a run of consecutive microbatches and a ring indexed by the microbatch mod its length
never overwrites a value still waiting.

Sends: what a stage's F makes reaches the next stage, and what its B makes the previous one, in
the following tick (`arrives_forward`, `arrives_backward`).

Legend: S stages, M microbatches, T ticks.
"""

import dataclasses
import functools

import numpy as np

# The passes, as the table writes them: BACKWARD is INPUT_GRAD and WEIGHT_GRAD in one (1F1B).
FORWARD, INPUT_GRAD, WEIGHT_GRAD, IDLE, BACKWARD = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Table:
    """kind[s, t], microbatch[s, t]: stage s's pass at tick t and its microbatch (0 when idle)."""

    kind: np.ndarray  # (S, T) int32
    microbatch: np.ndarray  # (S, T) int32
    arrives_forward: np.ndarray  # (S, T): the microbatch whose activations arrive after tick t, or -1
    arrives_backward: np.ndarray  # (S, T): the microbatch whose cotangent arrives after tick t, or -1
    # Ring lengths: the most microbatches any stage holds at once between two of its passes.
    residual_slots: int  # the forward's residuals, from F to W
    saved_slots: int  # what W reads from B, from B to W (0 when the backward is whole)
    input_slots: int  # activations arrived from the previous stage, until F reads them
    cotangent_slots: int  # cotangents arrived (or, on the last stage, from the loss), until B

    @property
    def ticks(self) -> int:
        return self.kind.shape[1]

    @property
    def passes(self) -> int:
        """Pass slots one microbatch takes on a stage: F and BW, or F, B and W."""
        return 2 if (self.kind == BACKWARD).any() else 3

    def idle(self) -> int:
        """Idle ticks of each stage (all stages idle alike)."""
        return int((self.kind == IDLE).sum(axis=1).max())


def _simulate(S: int, M: int, cap: int, wlimit: int, split: bool):
    """(F, B, W tick of each stage and microbatch) of the list scheduler, or None if it stalls;
    with `split` False B and W are one pass (their ticks equal)."""
    done = {k: np.full((S, M), -1, np.int64) for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)}
    n = {k: [0] * S for k in done}
    t = 0
    while min(n[WEIGHT_GRAD]) < M:
        picks = []
        for s in range(S):
            nf, nb, nw = n[FORWARD][s], n[INPUT_GRAD][s], n[WEIGHT_GRAD][s]
            ready_b = (
                nb < M
                and 0 <= done[FORWARD][s, nb] < t
                and (s == S - 1 or 0 <= done[INPUT_GRAD][s + 1, nb] < t)
            )
            ready_f = nf < M and nf - nw < cap and (s == 0 or 0 <= done[FORWARD][s - 1, nf] < t)
            if not split:
                picks.append((BACKWARD, nb) if ready_b else (FORWARD, nf) if ready_f else None)
                continue
            if ready_b:
                picks.append((INPUT_GRAD, nb))
            elif nb - nw >= wlimit:
                picks.append((WEIGHT_GRAD, nw))
            elif ready_f:
                picks.append((FORWARD, nf))
            elif nw < nb:
                picks.append((WEIGHT_GRAD, nw))
            else:
                picks.append(None)
        for s, pick in enumerate(picks):
            if pick is not None:
                kind, m = pick
                for k in (INPUT_GRAD, WEIGHT_GRAD) if kind == BACKWARD else (kind,):
                    done[k][s, m] = t
                    n[k][s] += 1
        t += 1
        if t > 4 * (3 * M + S):
            return None
    return done, t


def _most_held(start: np.ndarray, end: np.ndarray) -> int:
    """The most microbatches held at once, each from the end of tick start[m] to tick end[m]."""
    ticks = np.arange(max(int(end.max()), 0) + 1)
    return int(((start[:, None] <= ticks[None]) & (ticks[None] < end[:, None])).sum(axis=0).max())


@functools.lru_cache(maxsize=64)
def table(S: int, M: int, split: bool = True) -> Table:
    """ZB-H1's table (`split`) for S stages and M >= S microbatches, in 3 M + S - 1 ticks, or
    1F1B's, in 2 (M + S - 1)."""
    target = 3 * M + S - 1 if split else 2 * (M + S - 1)
    best = None
    for cap in range(S, 2 * S + 3):
        for wlimit in range(1, S + 3) if split else (1,):
            found = _simulate(S, M, cap, wlimit, split)
            if found is not None and found[1] == target:
                best = found
                break
        if best is not None:
            break
    if best is None:
        name = "ZB-H1" if split else "1F1B"
        raise ValueError(f"no {name} table of {target} ticks for {S} stages and {M} microbatches")
    done, T = best
    F, Bk, Wk = done[FORWARD], done[INPUT_GRAD], done[WEIGHT_GRAD]
    kind = np.full((S, T), IDLE, np.int32)
    microbatch = np.zeros((S, T), np.int32)
    for k, when in done.items():
        for s in range(S):
            kind[s, when[s]] = k if split or k == FORWARD else BACKWARD
            microbatch[s, when[s]] = np.arange(M)
    arrives_forward = np.full((S, T), -1, np.int32)
    arrives_backward = np.full((S, T), -1, np.int32)
    for s in range(S):
        if s > 0:
            arrives_forward[s, F[s - 1]] = np.arange(M)
        if s < S - 1:
            arrives_backward[s, Bk[s + 1]] = np.arange(M)
    return Table(
        kind=kind,
        microbatch=microbatch,
        arrives_forward=arrives_forward,
        arrives_backward=arrives_backward,
        # A pass's value is written in its tick and read in a later one: held from its tick to the
        # reader's (the reader's tick included, for the ring's slot must not be written by then).
        residual_slots=max(_most_held(F[s], Wk[s] + 1) for s in range(S)),
        saved_slots=max(_most_held(Bk[s], Wk[s] + 1) for s in range(S)) if split else 0,
        input_slots=max([_most_held(F[s - 1], F[s] + 1) for s in range(1, S)]),
        cotangent_slots=max(
            [_most_held(Bk[s + 1], Bk[s] + 1) for s in range(S - 1)] + [_most_held(F[S - 1], Bk[S - 1] + 1)]
        ),
    )
