"""Example results of every scenario, every kind of field filled in (FLAT groups present and
absent, nested dataclasses, dicts and lists of them, optionals, a subclass in a dict): what
the round-trip test rebuilds and the report tests vary (`dataclasses.replace`)."""

from __future__ import annotations

from typing import Any

from kvkeep.bench.http import AgentsSummary, TurnResult
from kvkeep.bench.metrics import HitRates
from kvkeep.bench.prompts import Queried
from kvkeep.bench.scenarios.agents import AgentsResult, PoolFit, ReplicasResult
from kvkeep.bench.scenarios.capacity import CapacityResult, CapacityRound
from kvkeep.bench.scenarios.hol import HOLResult
from kvkeep.bench.scenarios.replay import ReplayResult
from kvkeep.bench.scenarios.restart import RemoteRestartResult, Requeried, summarize
from kvkeep.bench.scenarios.session import summarize_session
from kvkeep.bench.scenarios.soak import SoakResult
from kvkeep.bench.scenarios.soak_faults import SoakSpec
from kvkeep.bench.scenarios.store import StoreResult
from kvkeep.bench.scenarios.ttft import AfterRestart, SizeTTFT, TTFTResult
from kvkeep.traffic.workload import SessionSpec

RATES = HitRates(0.75, 0.25, 0.5, {"ram_hit_rate": 0.375, "disk_hit_rate": 0.125})


def session() -> Any:
    rows = [
        TurnResult(0, i, 1000 * (i + 1), 896 * i, 1000 * (i + 1) - 896 * i, 8, 0.1, 0.2, float(i))
        for i in range(3)
    ]
    return summarize_session(rows, {"vllm:prompt_tokens_total": 6000.0})


def ttft() -> TTFTResult:
    cold = SizeTTFT(1.0, 0.1, [1.0, 1.1], [0.1, 0.12], 10.0, 0, 896, 1000)
    after = AfterRestart(0.2, 896, 0.896, 21.5)
    again = SizeTTFT(4.0, 0.3, [4.0], [0.3], None, 0, 3968, 4096, after)
    return TTFTResult({"1000": cold, "4096": again})


def capacity() -> CapacityResult:
    rounds = [CapacityRound(r, RATES, 0.3, 0.25, 4096, 12.5) for r in range(3)]
    return CapacityResult(RATES, 0.3, rounds, 16, 2048, 128, 4.0, 2, 16, 128, None)


FIT = PoolFit(2.5, 128)


def agents(fit: PoolFit | None = FIT) -> AgentsResult:
    summary = AgentsSummary(2, 4, 60.0, 4.0, {"0": 2.0}, {"0": [1.0, 1.5]}, 1.0, 1.0, 0.1)
    return AgentsResult(summary, RATES, 0.5, 1000, 0.2, SessionSpec(scale=0.08), 128, 800, fit)


def replicas() -> ReplicasResult:
    summary = AgentsSummary(2, 4, 60.0, 4.0, {"0": 2.0}, {"0": [1.0]}, 1.0, 1.0, 0.1)
    rates = HitRates(0.7, 0.5, 0.2, {"remote_hit_rate": 0.2})
    return ReplicasResult(summary, rates, 2, True)


def hol() -> HOLResult:
    return HOLResult(0.05, 0.2, 4.0, 0.7, 0.75, 1.07, 896, "kvkeep", 1024, 8192, 256, None)


def replay() -> ReplayResult:
    return ReplayResult(
        0.8, 0.3, 0.5, {"ram": 0.4, "disk": 0.1}, 4800, 1440, 2400, 960, 0.8, 0.1, 0.2, 0.3,
        24, 12.0, 120.0, 60.0, 90.0, 4, 3640, 25, 1.14, 4, [0.1, 0.2, 0.3],
        [{"t_s": 2.0, "device_hit_rate": 0.1, "kvkeep_hit_rate": 0.4}],
        [[0, 0], [1, 0], [0, 1]], {"traces": ["trace_0086"], "block_tokens": 4},
    )  # fmt: skip


def restart() -> Any:
    plain = Queried(RATES, 0.4, [0.4, 0.41], 8064)
    after = Requeried(RATES, 0.1, [0.1], 8064, 0.3, 0.5, 0.05)
    phases: dict[str, Queried] = {"warmup": plain, "warm": plain}
    phases |= {"after_engine_restart": after, "after_server_sigterm": after}
    phases["after_server_sigkill"] = Requeried(HitRates(0.5), 0.2, [0.2], 8064, 0.3)
    return summarize(20.0, [21.0, 22.5, 21.5], phases)


def restart_remote() -> RemoteRestartResult:
    q = Queried(HitRates(1.0, 0.0, 1.0, {"remote_hit_rate": 1.0}), 0.2, [0.2], 4096)
    phases = {"cold": q, "ram": q, "remote": q, "ram_after_remote": q}
    return RemoteRestartResult(4.0, 0.1, 0.2, 0.1, 8192, 2048, 1.0, 1.0, 0, 0, 1 << 20, 0, phases)


def soak() -> SoakResult:
    return SoakResult(
        SoakSpec(minutes=1.0), 120, 0, 2, 0, 120, 960, 1, 0.05, 3, 1, 1, 0,
        {"deferred": 1.0, "evicted": 0.0}, 2, 64, 1.0, 300.0, 4096.0, 128.0, 0.6, 0.5, None,
        [{"t_s": 0.0, "requests": 10, "cached_fraction": 0.5, "kvkeep_hit_blocks": 3.0}],
        [{"t_s": 0.0, "server_mb": 50.0, "vllm_mb": None}], {"server_mb": 1.5, "vllm_mb": None},
        [{"t_s": 12.0, "kind": "server_kill", "took_s": 2.1, "detail": ""}], [], ["x"],
        30.0, 60.0,
    )  # fmt: skip


def store() -> StoreResult:
    return StoreResult(
        1 << 20, 1 << 29, 10.0, 5.0, 6.0, 5.5, 2.0, 0.5, 2.5, 0.4,
        {"read": 0.1, "copy": 0.2}, {"disk_get_gbps": [2.0, 2.1]},
    )  # fmt: skip


# {scenario name, as the results file it: an example result}
EXAMPLES: dict[str, Any] = {
    "session": session(),
    "ttft": ttft(),
    "capacity": capacity(),
    "agents": agents(),
    "agents_fit": agents(None),
    "agents_replicas": replicas(),
    "hol": hol(),
    "replay": replay(),
    "restart": restart(),
    "restart_remote": restart_remote(),
    "soak": soak(),
    "store": store(),
}
