"""`kvkeep bench agents` (S5): N coding agents on one engine, closed loop.

Each agent runs its own session from the workload generator: it sends a turn, waits for the
whole answer, "runs" its tool for `tool_delay_s`, then sends the next turn. Throughput is turns
per minute across all agents; the wait per turn is the request latency an agent sees. The study
saw about 8 turns/min without caching and about 60 with it, and a late turn's wait fall from
about 104 s to 2.1 s.

Whether caching helps depends on whether the agents' working set (every agent's context)
fits in the device pool, so the scenario reports that ratio next to the results.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from kvkeep.bench.probe import Probe, hit_split
from kvkeep.bench.runner import run_agents, summarize_agents
from kvkeep.workload import SessionSpec, TokenCounter, generate_sessions


@dataclass
class AgentsScenario:
    spec: SessionSpec
    counter: TokenCounter
    agents: int = 8
    tool_delay_s: float = 0.5
    pool_tokens: int | None = None  # the device pool, to report the working-set ratio
    block_size: int = 128
    probe_stats: Any = None
    name: str = "agents"

    def tokens_needed(self) -> int:
        return int(self.spec.final_target * 1.1) + self.spec.max_output_tokens + 256

    def run(self, url: str) -> dict[str, Any]:
        if self.agents < 1:
            raise ValueError("--agents must be at least 1")
        sessions = generate_sessions(self.spec, self.counter, self.agents)
        probe = Probe(url, self.probe_stats)
        before = probe.snapshot()
        total = sum(len(s) for s in sessions)
        t0 = time.perf_counter()
        with tqdm(total=total, desc=f"  {self.agents} agents' turns", leave=False) as bar:
            results = asyncio.run(
                run_agents(url, sessions, self.tool_delay_s, progress=lambda _: bar.update())
            )
        wall = time.perf_counter() - t0
        out = summarize_agents(results, wall, self.agents)
        prompt = sum(r.prompt_tokens for r in results)
        out.update(hit_split(probe.delta(before), prompt, self.block_size))
        out["cached_fraction"] = sum(r.cached_tokens for r in results) / prompt
        working_set = self.agents * self.spec.final_target
        out["working_set_tokens"] = working_set
        if self.pool_tokens:
            out["working_set_over_pool"] = working_set / self.pool_tokens
        out["tool_delay_s"] = self.tool_delay_s
        out["spec"] = asdict(self.spec)
        out["block_size"] = self.block_size
        out["prompt_tokens"] = prompt
        if self.pool_tokens:
            out["pool_blocks"] = self.pool_tokens // self.block_size
        return out


def main(argv: list[str]) -> int:
    """`kvkeep bench agents`: S5 per cache mode."""
    import argparse
    import sys

    import httpx

    from kvkeep.bench import scenarios as sc

    p = argparse.ArgumentParser(prog="kvkeep bench agents", description=__doc__.splitlines()[0])
    sc.add_common_args(p)
    sc.add_session_args(p)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--tool-delay", type=float, default=0.5, help="seconds a tool call takes")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="vLLM replicas, each with its own kvkeep server, turns round-robin",
    )
    p.add_argument(
        "--remote",
        metavar="URL",
        help="with --replicas: the shared Valkey/Redis (default: a private one)",
    )
    p.add_argument("--no-shared-store", action="store_true",
                   help="with --replicas: no shared tier, for comparison")  # fmt: skip
    p.set_defaults(scale=0.05)
    args = p.parse_args(argv[1:])
    if args.replicas > 1:
        return _main_replicas(args)
    try:
        scenario = AgentsScenario(
            sc.session_spec(args),
            sc.token_counter(args),
            agents=args.agents,
            tool_delay_s=args.tool_delay,
            pool_tokens=args.num_blocks * 128 if args.num_blocks else None,
        )
        by = sc.run_modes([scenario], args.modes, sc.launch_config(args), args.endpoint)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"kvkeep bench agents: {exc}", file=sys.stderr)
        return 1
    sc.write_outputs({"scenario": "agents", "modes": by["agents"]}, args)
    return 0


def _main_replicas(args: Any) -> int:
    """`kvkeep bench agents --replicas N`: remote-tier hits across replicas."""
    import sys

    import httpx

    from kvkeep.bench import scenarios as sc
    from kvkeep.bench.remote_bench import RemoteSpec, ReplicatedAgentsScenario

    if args.endpoint:
        print("--replicas launches its own servers; --endpoint is not supported", file=sys.stderr)
        return 2
    scenario = ReplicatedAgentsScenario(
        sc.session_spec(args),
        sc.token_counter(args),
        agents=args.agents,
        replicas=args.replicas,
        tool_delay_s=args.tool_delay,
        remote=None if args.no_shared_store else RemoteSpec(url=args.remote),
    )
    base = sc.launch_config(args)
    assert base is not None
    try:
        result = scenario.run(base)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"kvkeep bench agents --replicas: {exc}", file=sys.stderr)
        return 1
    name = "no shared store" if args.no_shared_store else "shared store"
    sc.write_outputs({"scenario": "agents_replicas", "modes": {name: result}}, args)
    return 0
