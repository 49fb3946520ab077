"""`kvkeep bench agents` (S5): N coding agents on one engine, closed loop.

Each agent runs its own generated session: it sends a turn, waits for the whole answer, "runs"
its tool for `tool_delay_s`, then sends the next turn. Whether caching helps depends on whether
the agents' working set fits in the device pool, so the result holds that ratio (`PoolFit`).

With `--replicas N` (mode kvkeep), the agents' turns go round-robin over N vLLMs, each with
its own cache server, as on separate hosts: a turn's prefix was computed on another replica,
so with the shared store (`--remote URL`, or a private redis-server) it is a remote hit, and
without it (`--no-shared-store`) a recompute.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import operator
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from kvkeep.bench.command import Claim, Command, InSuite, Section, SuiteRun
from kvkeep.bench.context import RunContext
from kvkeep.bench.http import (
    LATE_TURNS,
    AgentsSummary,
    run_agents,
    summarize_agents,
    summarize_sample,
)
from kvkeep.bench.metrics import HitRates, Probe, hit_split
from kvkeep.bench.pace import Pace
from kvkeep.bench.report.plots import bar_plot
from kvkeep.bench.report.results import Run
from kvkeep.bench.report.tables import Column, Table, count, one_place, pct, secs
from kvkeep.bench.result import FLAT
from kvkeep.bench.sampling import balanced_turns, grid_turns, turn_work
from kvkeep.bench.scenario import Needs
from kvkeep.bench.scenarios import session
from kvkeep.traffic.workload import SessionSpec, TokenCounter, generate_sessions

BASELINES = ("none", "vllm")  # the modes a baseline stride samples
# The widest time-boxed stride: 3 of a 30-turn session's turns, whose prompt, attention and new
# tokens still average within about 2% of the session's (`bench.sampling`), and whose last
# two give the late-turn wait.
STRIDE_MOST = 10
QUICK_STRIDE = 3  # `make demo`'s stride on the reference machine (`InSuite` below)


@dataclass(frozen=True)
class PoolFit:
    """How the agents' working set compares with the device pool, where that is known."""

    working_set_over_pool: float
    pool_blocks: int


@dataclass(frozen=True)
class AgentsRun:
    """What every agents run measures: the turns and where their hits came from."""

    summary: AgentsSummary = field(metadata=FLAT)
    rates: HitRates = field(metadata=FLAT)


@dataclass(frozen=True)
class AgentsResult(AgentsRun):
    """Agents on one engine."""

    cached_fraction: float
    working_set_tokens: int
    tool_delay_s: float
    spec: SessionSpec
    block_size: int
    prompt_tokens: int
    fit: PoolFit | None = field(default=None, metadata=FLAT)
    # With a baseline stride > 1: every mode's figures over the sampled turns alone (the
    # baselines ran only those; kvkeep ran them all), which the claims and table compare.
    stride: int = 1
    sampled: AgentsSummary | None = None
    sample: list[int] | None = None  # the sampled turns (`bench.sampling.balanced_turns`)


@dataclass(frozen=True)
class ReplicasResult(AgentsRun):
    """Agents whose turns go round-robin over replicas."""

    replicas: int
    shared_store: bool
    routing: str = "round robin per turn"


@dataclass
class AgentsScenario:
    spec: SessionSpec
    counter: TokenCounter
    agents: int = 8
    tool_delay_s: float = 0.5
    pool_tokens: int | None = None  # the device pool, to report the working-set ratio
    block_size: int = 128
    replicas: int = 1
    shared_store: bool = True  # with replicas > 1
    name: str = "agents"
    # The baselines (modes none and vllm) run every stride-th turn of each session to bound
    # their time (a third of `make demo` went to them at stride 1); kvkeep runs every turn.
    baseline_stride: int = 1
    # Given (`make demo`): the stride widens on a machine slower than the reference
    # (`kvkeep.bench.pace`), up to one turn in STRIDE_MOST.
    pace: Pace | None = None

    def stride(self) -> int:
        """The baselines' stride: ``baseline_stride``, widened by the pace where there is one.
        Read when the modes start, after S2 measured the pace, so every mode samples alike."""
        if self.pace is None or self.baseline_stride <= 1:
            return self.baseline_stride
        return self.pace.stride(self.baseline_stride, STRIDE_MOST)

    def needs(self) -> Needs:
        if self.replicas == 1:
            return Needs(tokens=session.session_tokens(self.spec))
        return Needs(
            tokens=session.session_tokens(self.spec),
            modes=("kvkeep",),
            own_engine=True,
            replicas=self.replicas,
            shared_store=self.shared_store,
        )

    def run(self, ctx: RunContext) -> AgentsResult | ReplicasResult:
        if self.agents < 1 or self.replicas < 1:
            raise ValueError("--agents and --replicas must be at least 1")
        sessions = generate_sessions(self.spec, self.counter, self.agents)
        stride = self.stride()
        sample = balanced_turns(turn_work(sessions), stride)
        if ctx.mode in BASELINES and stride > 1:
            sessions = [[t for t in turns if t.index in sample] for turns in sessions]
        probes = [ctx.probe(i) for i in range(len(ctx.urls))]
        before = [p.snapshot() for p in probes]
        t0 = time.perf_counter()
        with tqdm(
            total=sum(map(len, sessions)), desc=f"  {self.agents} agents' turns", leave=False
        ) as bar:
            results = asyncio.run(
                run_agents(ctx.urls, sessions, self.tool_delay_s, lambda _: bar.update())
            )
        summary = summarize_agents(results, time.perf_counter() - t0, self.agents)
        delta = functools.reduce(operator.add, map(Probe.delta, probes, before))
        prompt = sum(r.prompt_tokens for r in results)
        rates = hit_split(delta, prompt)
        if self.replicas > 1:
            return ReplicasResult(summary, rates, self.replicas, self.shared_store)
        working_set, pool = self.agents * self.spec.final_target, self.pool_tokens
        fit = PoolFit(working_set / pool, pool // self.block_size) if pool else None
        sampled = None
        if stride > 1:
            sampled = summarize_sample(results, sample, self.tool_delay_s, self.agents, stride)
        return AgentsResult(
            summary,
            rates,
            sum(r.cached_tokens for r in results) / prompt,
            working_set,
            self.tool_delay_s,
            self.spec,
            self.block_size,
            prompt,
            fit,
            stride,
            sampled,
            sample if sampled else None,
        )


def add_args(p: argparse.ArgumentParser) -> None:
    session.add_args(p)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--tool-delay", type=float, default=0.5, help="seconds a tool call takes")
    p.add_argument(
        "--baseline-stride",
        type=int,
        default=1,
        metavar="N",
        help="modes none and vllm run one turn in N (kvkeep every turn) and every mode is "
        "compared on those turns, as make demo does with 3 (default: 1, every turn)",
    )
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
    p.add_argument(
        "--no-shared-store",
        action="store_true",
        help="with --replicas: no shared tier, for comparison",
    )
    p.set_defaults(scale=0.05)


def build(args: argparse.Namespace) -> list[AgentsScenario]:
    spec, counter = session.session_spec(args), session.token_counter(args)
    if args.baseline_stride < 1:
        raise ValueError("--baseline-stride must be at least 1 (1: every mode runs every turn)")
    one = AgentsScenario(
        spec,
        counter,
        agents=args.agents,
        tool_delay_s=args.tool_delay,
        baseline_stride=args.baseline_stride,
    )
    if args.replicas <= 1:
        return [replace(one, pool_tokens=args.num_blocks * 128 if args.num_blocks else None)]
    shared = not args.no_shared_store
    name = f"agents_replicas@{'shared store' if shared else 'no shared store'}"
    return [replace(one, replicas=args.replicas, shared_store=shared, name=name)]


@dataclass(frozen=True)
class InSuiteAgents:
    """S5's knobs in `bench all`; with ``fit_scale``, a second run (``agents_fit``) whose
    working set fits in the suite's pool."""

    agents: int
    turns: int
    scale: float
    fit_scale: float | None = None
    baseline_stride: int = 1


def _in_suite(size: InSuiteAgents, run: SuiteRun) -> list[AgentsScenario]:
    spec = SessionSpec(turns=size.turns, scale=size.scale, max_output_tokens=4)
    one = AgentsScenario(
        spec,
        run.counter,
        agents=size.agents,
        tool_delay_s=0.2,
        pool_tokens=run.pool_tokens,
        baseline_stride=size.baseline_stride,
        pace=run.pace,
    )
    if not size.fit_scale:
        return [one]
    return [one, replace(one, spec=replace(spec, scale=size.fit_scale), name="agents_fit")]


def _ratio(result: AgentsResult | None) -> float | None:
    """The working set over the device pool, where the pool is known."""
    return result.fit.working_set_over_pool if result and result.fit else None


def _units(result: AgentsResult) -> AgentsSummary:
    """The figures every mode is compared on: over the sampled turns where the baselines
    sampled them, else over every turn."""
    return result.sampled or result.summary


def _agents_head(run: Run[AgentsResult]) -> str:
    """ "### S5: 8 closed-loop agents, working set 2.80x the device pool (exceeds it)"."""
    n, ratio = (run.first.summary.agents if run.first else ""), _ratio(run.first)
    title = f"{n} concurrent closed-loop agents"
    if ratio is not None:
        fits = "exceeds it" if ratio > 1 else "fits in it"
        title = f"{n} closed-loop agents, working set {ratio:.2f}x the device pool ({fits})"
    study = "Study: ~8 turns/min without a cache, ~60 with; late-turn wait 104 s -> 2.1 s."
    head = f"### S5: {title}\n\n{study}\n\n"
    sampled = [r for r in run.modes.values() if r.sampled]
    if sampled:
        r = sampled[0]
        turns = r.sample or grid_turns(r.spec.turns, r.stride)  # results from before the
        # balanced sample ran the grid
        head += (
            f"To bound their time, modes {' and '.join(BASELINES)} ran one turn in {r.stride} "
            f"of each session ({len(turns)} of {r.spec.turns}: turns "
            f"{', '.join(map(str, turns))}; one from each {r.stride} in a row, those whose "
            "prompt and new tokens average closest to the whole session's) and kvkeep every "
            "turn; every figure below is over those sampled "
            "turns in every mode (an agent's time: its turns' latencies and tool delays), "
            "the late-turn wait over the last "
            f"{max(1, -(-LATE_TURNS // r.stride))} of them. kvkeep over all its turns: "
            + ", ".join(
                f"{r.summary.turns_per_min:.1f} turns/min, late-turn wait "
                f"{r.summary.late_turn_wait_s:.3f} s"
                for m, r in run.modes.items()
                if m not in BASELINES
            )
            + ".\n\n"
        )
    return head


agents_table: Table[AgentsResult] = Table(
    _agents_head,
    (
        Column("turns/min", lambda r: _units(r).turns_per_min, one_place),
        Column("mean wait", lambda r: _units(r).mean_wait_s),
        Column("late-turn wait", lambda r: _units(r).late_turn_wait_s),
        Column("cached", lambda r: r.cached_fraction, pct),
        Column("working set / pool", _ratio, lambda v: f"{v or 0:.2f}"),
        Column("turns run", lambda r: r.summary.turns, count),
    ),
)

replicas_table: Table[ReplicasResult] = Table(
    "### Agents over replicas, turns routed round-robin\n\n",
    (
        Column("turns/min", lambda r: r.summary.turns_per_min, one_place),
        Column("hit rate", lambda r: r.rates.hit_rate, pct),
        Column("device", lambda r: r.rates.device_hit_rate, pct),
        Column("remote", lambda r: r.rates.tiers.get("remote_hit_rate"), pct),
        Column("mean TTFT", lambda r: r.summary.mean_ttft_s),
    ),
    first="store",
)


def plot_agents(
    run: Run[AgentsResult], out: Path, fit: Run[AgentsResult] | None = None
) -> list[Path]:
    """Turns/min by mode; with ``fit`` (the run whose working set fits), both runs side by side."""
    series: dict[str, list[float]] = {}
    for each in filter(None, (run, fit)):
        ratio = _ratio(each.first)
        label = "turns/min" if ratio is None else f"working set {ratio:.2f}x pool"
        series[label] = [
            _units(r).turns_per_min if (r := each.modes.get(m)) else 0.0 for m in run.modes
        ]
    return bar_plot(
        out / "turns_per_min.png",
        list(run.modes),
        series,
        "turns per minute",
        "S5: agents' turns per minute, by mode",
    )


CLAIMS: tuple[Claim[AgentsResult], ...] = (
    Claim(
        "S5 turns/min, agents > pool",
        "~8 -> ~60",
        "agents",
        lambda r: _units(r).turns_per_min,
        one_place,
    ),
    Claim(
        "S5 late-turn wait", "104 s -> 2.1 s", "agents", lambda r: _units(r).late_turn_wait_s, secs
    ),
)


COMMAND = Command(
    name="agents",
    help="N concurrent closed-loop agents (S5)",
    add_args=add_args,
    build=build,
    sections={
        "agents": Section(AgentsResult, agents_table, plot_agents, beside="agents_fit"),
        "agents_fit": Section(AgentsResult, agents_table),
        "agents_replicas": Section(ReplicasResult, replicas_table),
    },
    claims=CLAIMS,
    # Agents run the study's 30 turns. On this small model prefill time is mostly attention,
    # so what caching saves grows with the turns (about turns / 3 by counting attention work,
    # less per-turn fixed costs): 14-turn sessions measured ~5x over no cache, 30 turns
    # 5.9-7.7x.
    in_suite=InSuite(
        # The demo's baselines run one turn in three (`bench.sampling.balanced_turns`): 127 s
        # and 95 s at stride 1 on 2 cores with AMX, of a 16-minute run (kvkeep's 22 s).
        quick=InSuiteAgents(agents=8, turns=30, scale=0.08, baseline_stride=QUICK_STRIDE),
        full=InSuiteAgents(agents=8, turns=30, scale=0.1, fit_scale=0.02),
        runs={50: _in_suite},
        # seconds in all three modes, engine starts included (`make demo`, 2 cores with AMX)
        quick_s={"agents": 94},
    ),
)
