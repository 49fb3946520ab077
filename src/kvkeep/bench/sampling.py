"""Which turns of a session a time-boxed baseline runs (S5's ``baseline_stride``).

A baseline that runs one turn in ``stride`` is compared with kvkeep on those turns alone, so
the sample must carry each mode's average work, not only the baselines'. A plain grid (turns
1, 4, ..., 28 at stride 3) does for a no-cache baseline, which re-reads the whole prompt, but
not for kvkeep, which computes what is new since the last turn: a session's turn 1 adds its
first tool result, about three times a later turn's new tokens, and the grid's 10 turns held
10% more of kvkeep's work than its average 10. In one demo run kvkeep's figure over the grid
was 638 turns/min against 697 over all its turns, which put kvkeep/none 9% low.

`balanced_turns` keeps one turn in each run of ``stride`` consecutive turns (so the sample
spans the session as the grid does) and picks, within those runs, the turns whose prompt
tokens, squared prompt tokens (attention) and new tokens average closest to the session's.
It reads only the workload, before anything runs, and every mode gets the same turns.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvkeep.traffic.workload import Turn


def grid_turns(turns: int, stride: int) -> list[int]:
    """Every ``stride``-th turn of a ``turns``-turn session, starting half a stride in, so
    that their mean index is the session's: 30 turns at stride 3 give 1, 4, ..., 28. Stride 1:
    every turn."""
    return list(range((stride - 1) // 2, turns, stride)) if stride > 1 else list(range(turns))


def turn_work(sessions: Sequence[Sequence[Turn]]) -> list[tuple[float, float, float]]:
    """Per turn index, averaged over the sessions: (prompt tokens, prompt tokens squared, new
    tokens since the turn before). The first is what a mode without a cache computes, the
    second its attention, the third what a mode that keeps the prefix computes."""
    n = min(len(s) for s in sessions)
    out = []
    for i in range(n):
        prompt = [s[i].target_tokens for s in sessions]
        new = [s[i].target_tokens - (s[i - 1].target_tokens if i else 0) for s in sessions]
        out.append(
            (
                sum(prompt) / len(sessions),
                sum(p * p for p in prompt) / len(sessions),
                sum(new) / len(sessions),
            )
        )
    return out


def sample_error(work: Sequence[Sequence[float]], sample: Sequence[int]) -> float:
    """The largest relative difference, over the measures, between the sample's mean and the
    session's."""
    worst = 0.0
    for j in range(len(work[0])):
        whole = sum(w[j] for w in work) / len(work)
        part = sum(work[t][j] for t in sample) / len(sample)
        worst = max(worst, abs(part / whole - 1) if whole else 0.0)
    return worst


def balanced_turns(
    work: Sequence[Sequence[float]], stride: int, keep_last: bool = False
) -> list[int]:
    """One turn from each run of ``stride`` consecutive turns, chosen so that the sample's
    mean of every measure in ``work`` (one row per turn) is as close to the session's as a
    change of one turn at a time gets it, starting from `grid_turns`; with ``keep_last``,
    the last run's pick is the session's last turn (S1 reports it) and the others balance
    around it. Deterministic: the same work gives the same turns."""
    n = len(work)
    if stride <= 1 or n == 0:
        return list(range(n))
    strata = [list(range(s, min(s + stride, n))) for s in range(0, n, stride)]
    if keep_last:
        strata[-1] = [n - 1]
    centre = (stride - 1) // 2
    pick = [st[min(centre, len(st) - 1)] for st in strata]
    best = sample_error(work, pick)
    improved = True
    while improved:
        improved = False
        for k, stratum in enumerate(strata):
            for t in stratum:
                trial = [*pick[:k], t, *pick[k + 1 :]]
                err = sample_error(work, trial)
                if err < best - 1e-12:
                    best, pick, improved = err, trial, True
    return pick
