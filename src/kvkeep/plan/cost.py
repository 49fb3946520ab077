"""Cost model: prefill time, load time per tier, TTFT and turns/min of a configuration.

Prefill of a cold prompt of ``n`` tokens takes ``overhead + linear * n + quadratic * n**2``
seconds (attention makes the cost grow faster than linearly; DESIGN.md's measurements). With
``h`` tokens cached, the ``n - h`` others still attend to all of them, so the compute left is
``overhead + linear * (n - h) + quadratic * (n**2 - h**2)``. Loading ``t`` tokens from a tier
of ``G`` GB/s takes ``t * bytes_per_token / (G * 1e9)`` seconds, added to the compute (kvkeep
loads before the forward pass).

Turns per minute for ``N`` closed-loop agents sharing one engine use the operational-law
bound ``X = min(N / (S + Z), 1 / S)``, with ``S`` the engine time per turn (TTFT plus decode)
and ``Z`` the agent's tool delay: the engine serialises prefills, agents think in parallel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from kvkeep.plan.stackdist import StackDistances
from kvkeep.plan.tiers import TierSpec, reaches
from kvkeep.plan.trace import BlockTrace

GB = 1e9
CALIBRATION_SIZES = (512, 2048, 8192)
Num = TypeVar("Num", float, npt.NDArray[np.float64])


@dataclass(frozen=True)
class PrefillModel:
    """Seconds to prefill: ``overhead_s + linear_s * n + quadratic_s * n**2``."""

    linear_s: float
    quadratic_s: float = 0.0
    overhead_s: float = 0.0
    source: str = "given"

    def __post_init__(self) -> None:
        if min(self.linear_s, self.quadratic_s, self.overhead_s) < 0 or self.linear_s == 0:
            raise ValueError("--prefill-s-per-token must be positive (and the others >= 0)")

    def compute_s(self, prompt_tokens: Num, cached_tokens: Num) -> Num:
        """Seconds to compute the uncached part of a prompt, attending to the cached part.

        Elementwise on arrays of prompts."""
        new = prompt_tokens - cached_tokens
        quad = prompt_tokens**2 - cached_tokens**2
        return self.overhead_s + self.linear_s * new + self.quadratic_s * quad

    def recompute_s_per_token(self, context_tokens: float) -> float:
        """Average seconds per token to recompute a prefix of ``context_tokens``."""
        return self.linear_s + self.quadratic_s * context_tokens


class Measurement(NamedTuple):
    prompt_tokens: int
    ttft_s: float


def fit_prefill(measurements: Sequence[Measurement]) -> PrefillModel:
    """Least-squares fit of overhead + linear + quadratic to cold TTFTs, all terms >= 0.

    Needs at least two distinct sizes (three to fit the quadratic term); raises ValueError
    naming what to measure otherwise. Negative terms are dropped and the rest refitted.
    """
    sizes = {m.prompt_tokens for m in measurements}
    if len(sizes) < 2:
        raise ValueError("calibration needs cold TTFTs of at least two prompt sizes")
    n = np.array([m.prompt_tokens for m in measurements], dtype=np.float64)
    y = np.array([m.ttft_s for m in measurements], dtype=np.float64)
    columns = [np.ones_like(n), n, n * n] if len(sizes) >= 3 else [np.ones_like(n), n]
    keep = list(range(len(columns)))
    while True:
        coef = np.linalg.lstsq(np.stack([columns[k] for k in keep], 1), y, rcond=None)[0]
        negative = [k for k, c in zip(keep, coef, strict=True) if c < 0 and k != 1]  # linear stays
        if not negative:
            break
        keep.remove(min(negative, key=lambda k: coef[keep.index(k)]))
    terms = dict.fromkeys(range(3), 0.0)
    terms.update({k: max(0.0, float(c)) for k, c in zip(keep, coef, strict=True)})
    return PrefillModel(
        linear_s=max(terms[1], 1e-12),
        quadratic_s=terms[2],
        overhead_s=terms[0],
        source=f"fitted to {len(measurements)} cold prompts of {sorted(sizes)} tokens",
    )


def calibrate(endpoint: str, sizes: Sequence[int] = CALIBRATION_SIZES) -> PrefillModel:
    """Measure cold TTFTs at ``sizes`` against a live OpenAI-compatible server and fit them.

    Blocks for the duration; each prompt is random token ids that no earlier prompt shares, so
    nothing is cached. Raises httpx / EndpointError errors from `kvkeep.traffic.endpoint` unchanged.
    """
    return fit_prefill(asyncio.run(_measure(endpoint.rstrip("/"), sizes)))


async def _measure(url: str, sizes: Sequence[int]) -> list[Measurement]:
    import httpx

    from kvkeep.traffic.endpoint import complete_ids, discover_model
    from kvkeep.traffic.workload import random_ids

    run = f"plan-calibrate:{time.time_ns()}"
    out = []
    async with httpx.AsyncClient() as client:
        model = await discover_model(client, url)
        await complete_ids(client, url, model, random_ids(32, f"{run}:first"))
        for size in sizes:
            ids = random_ids(size, f"{run}:{size}")
            stats = await complete_ids(client, url, model, ids)
            out.append(Measurement(stats.prompt_tokens, stats.ttft_s))
    return out


class Estimate(NamedTuple):
    """Expected performance of one configuration (a list of tiers, device first)."""

    name: str
    hit_rate: float
    token_hit_rate: float
    mean_ttft_s: float
    turns_per_min: float


@dataclass(frozen=True)
class Workload:
    """How the trace is driven: agents in closed loop, tool delay, decode cost."""

    agents: int = 1
    tool_delay_s: float = 0.0
    decode_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.agents < 1 or self.tool_delay_s < 0 or self.decode_s_per_token < 0:
            raise ValueError("--agents must be >= 1 and --tool-delay, --decode-s-per-token >= 0")


def estimate(
    name: str,
    sd: StackDistances,
    trace: BlockTrace,
    tiers: list[TierSpec],
    bytes_per_token: float,
    prefill: PrefillModel,
    workload: Workload,
) -> Estimate:
    """TTFT and turns/min for ``tiers`` (empty: no cache). Pure; O(references * tiers)."""
    tokens = np.array([r.tokens for r in trace.requests], dtype=np.float64)
    bt = trace.block_tokens
    served = np.zeros_like(tokens)
    load_s = np.zeros_like(tokens)
    for tier, reach in zip(tiers, reaches(tiers), strict=True):
        upto = np.minimum(sd.hits_per_request(reach) * bt, tokens)
        if tier.load_gbps is not None:
            load_s += (upto - served) * bytes_per_token / (tier.load_gbps * GB)
        served = upto
    ttft = prefill.compute_s(tokens, served) + load_s
    outputs = np.array([r.output_tokens for r in trace.requests], dtype=np.float64)
    busy = float(np.mean(ttft + outputs * workload.decode_s_per_token))
    per_s = min(workload.agents / (busy + workload.tool_delay_s), 1 / busy) if busy > 0 else 0.0
    cap = reaches(tiers)[-1] if tiers else 0
    return Estimate(
        name,
        sd.hit_rate(cap) if tiers else 0.0,
        float(served.sum() / max(1.0, tokens.sum())),
        float(np.mean(ttft)),
        60 * per_s,
    )


class LoadVerdict(NamedTuple):
    """Whether loading a token from a tier beats recomputing it at the workload's context."""

    tier: str
    load_s_per_token: float
    recompute_s_per_token: float
    worth_loading: bool


def load_verdict(
    tier: TierSpec, bytes_per_token: float, prefill: PrefillModel, context_tokens: float
) -> LoadVerdict | None:
    """None for a tier that loads nothing (the device)."""
    if tier.load_gbps is None:
        return None
    load = bytes_per_token / (tier.load_gbps * GB)
    recompute = prefill.recompute_s_per_token(context_tokens)
    return LoadVerdict(tier.name, load, recompute, load < recompute)
