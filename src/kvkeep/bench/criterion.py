"""When is a reply served with kvkeep's KV right? The one criterion every comparison uses
(the README's "What 'correct' means" gives the reasons; docs/notes/bench-criterion.md the
full terms and the measurements behind them).

1. ``same_as_hit``: equal to vLLM's own prefix-cache hit on the same prompt and the same KV,
   tokens and logprobs (``EXACT_TOL`` only absorbs JSON float formatting). It holds only
   against a hit on the copy kvkeep kept (the first of a block vLLM computes twice).
2. ``same_as_cold``: equal to a cold run up to the drift of vLLM's own prefix cache: logprobs
   within ``DRIFT_TOL`` where the tokens agree, and a token may differ only at a tie, where
   either reply lists the other's token among its best ``TOP_ALTERNATIVES`` within
   ``DRIFT_TOL`` of its own, at a logprob within ``DRIFT_TOL`` of the one the other reply
   gave it. Nothing after such a tie is compared: from there on the histories differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

EXACT_TOL = 1e-4
# the same sums in another order: bf16 logits carry 8 bits of mantissa, about 0.03 at a logit
# of 4; a wrong KV block moves logprobs by 0.5 to several nats on the tiny model
DRIFT_TOL = 0.1
# ask the server for this many top_logprobs: bf16 ties are often three-way, so two are not enough
TOP_ALTERNATIVES = 5


class Reply(NamedTuple):
    """A greedy reply: its tokens, their logprobs, and (optionally) each position's top
    alternatives as ``{token_id: logprob}`` (ask the server for ``TOP_ALTERNATIVES``)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    top: Sequence[Mapping[int, float]] = ()


@dataclass(frozen=True)
class Verdict:
    """``ok``, why not, how many tokens were compared and the largest logprob gap among them."""

    ok: bool
    why: str
    compared: int
    worst: float

    def __bool__(self) -> bool:
        return self.ok


def same_as_hit(candidate: Reply, hit: Reply, tol: float = EXACT_TOL) -> Verdict:
    """Rule 1: the same tokens and logprobs as vLLM's own prefix-cache hit on the same KV."""
    ours, theirs, n = list(candidate.token_ids), list(hit.token_ids), len(hit.token_ids)
    if ours != theirs:
        pairs = enumerate(zip(ours, theirs, strict=False))
        at = next((i for i, (x, y) in pairs if x != y), min(len(ours), n))
        worst = _max_gap(candidate.logprobs[: at + 1], hit.logprobs)
        why = f"token {at} differs from vLLM's own prefix-cache hit (logprobs by {worst:.3g})"
        return Verdict(False, why, at, worst)
    worst = _max_gap(candidate.logprobs, hit.logprobs)
    if worst > tol:
        return Verdict(False, f"logprobs differ by {worst:.4g} (> {tol:g})", n, worst)
    return Verdict(True, "", n, worst)


def same_as_cold(candidate: Reply, cold: Reply, tol: float = DRIFT_TOL) -> Verdict:
    """Rule 2: equal to a cold run up to numeric drift (see the module docstring). The
    replies need ``top`` to tell a tie from a wrong token; without it any token difference
    fails."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(candidate.token_ids, cold.token_ids, strict=False)):
        if a != b:
            if _tie(cold, i, a, candidate.logprobs[i], tol) or _tie(
                candidate, i, b, cold.logprobs[i], tol
            ):
                return Verdict(True, f"a tie at token {i} broke the other way", i, worst)
            return Verdict(False, f"token {i} differs from the cold run (no tie)", i, worst)
        gap = abs(candidate.logprobs[i] - cold.logprobs[i])
        worst = max(worst, gap)
        if gap > tol:
            return Verdict(False, f"token {i}: logprob differs by {gap:.4g} (> {tol:g})", i, worst)
    if len(candidate.token_ids) != len(cold.token_ids):
        return Verdict(False, "the replies differ in length", len(cold.token_ids), worst)
    return Verdict(True, "", len(cold.token_ids), worst)


def _max_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest logprob difference over positions where both replies have one."""
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0)


def _tie(reply: Reply, i: int, other: int, other_logprob: float, tol: float) -> bool:
    """Whether ``reply`` saw ``other`` within ``tol`` of the token it chose at ``i``, at
    about the logprob the other reply gave ``other`` (``other_logprob``, within ``tol``):
    drift moves each token's logprob by that much at most, so a flip that moved them more
    is no tie broken by drift. On the tiny models' flat replies (top logprobs near -4.5
    over 8,192 tokens) the first rule alone passed a reply from wrong KV about half the
    time: a token within 0.1 of the best is that common."""
    if i >= len(reply.top):
        return False
    seen = reply.top[i].get(other)
    return seen is not None and reply.logprobs[i] - seen <= tol and abs(seen - other_logprob) <= tol


def token_id(text: str) -> int:
    """A token of vLLM's OpenAI output under ``return_tokens_as_token_ids`` ("token_id:N")."""
    return int(text.removeprefix("token_id:"))
