"""`kvkeep bench session` and `kvkeep bench ttft`: the study's S1 and S2, per cache mode.

Each scenario measures one running endpoint and returns a JSON-ready dict. `run_modes` launches
vLLM in each requested mode in turn (same model, same pool, same pinned threads) and runs every
scenario against it, or measures an endpoint that is already running (`--endpoint`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import httpx
from tqdm import tqdm

from kvkeep.bench import report
from kvkeep.bench.environment import environment
from kvkeep.bench.launch import MODES, LaunchConfig, LaunchError, VLLMServer, cache_server
from kvkeep.bench.runner import TurnResult, metrics_delta, run_agents, scrape_metrics
from kvkeep.endpoint import complete_ids, discover_model
from kvkeep.workload import (
    DEFAULT_SCALE,
    CharEstimate,
    HFTokenizer,
    SessionGenerator,
    SessionSpec,
    TokenCounter,
)

DEFAULT_TTFT_SIZES = (4096, 16384)


class Scenario(Protocol):
    name: str

    def run(self, url: str) -> dict[str, Any]: ...

    def tokens_needed(self) -> int: ...


@dataclass
class SessionScenario:
    """S1: one coding-agent session, turn by turn; tokens re-read and TTFT per turn."""

    spec: SessionSpec
    counter: TokenCounter
    name: str = "session"

    def tokens_needed(self) -> int:
        return int(self.spec.final_target * 1.1) + self.spec.max_output_tokens + 256

    def run(self, url: str) -> dict[str, Any]:
        turns = SessionGenerator(self.spec, self.counter).turns()
        before = scrape_metrics(url)
        t0 = time.perf_counter()
        with tqdm(total=len(turns), desc="  session turns", unit="turn", leave=False) as bar:
            results = asyncio.run(run_agents(url, [turns], progress=lambda _: bar.update()))
        wall = time.perf_counter() - t0
        return summarize_session(results, wall, metrics_delta(before, scrape_metrics(url)))


def summarize_session(
    results: Sequence[TurnResult], wall_s: float, metrics: dict[str, float]
) -> dict[str, Any]:
    """Per-turn rows plus the totals the study quotes."""
    rows = sorted(results, key=lambda r: (r.agent, r.turn))
    prompt = sum(r.prompt_tokens for r in rows)
    computed = sum(r.computed_tokens for r in rows)
    return {
        "turns": [
            {k: v for k, v in r.to_dict().items() if k not in ("agent", "start_s")} for r in rows
        ],
        "total_prompt_tokens": prompt,
        "total_cached_tokens": prompt - computed,
        "total_computed_tokens": computed,
        "last_turn_prompt_tokens": rows[-1].prompt_tokens,
        "last_turn_computed_tokens": rows[-1].computed_tokens,
        "max_turn_computed_tokens": max(r.computed_tokens for r in rows),
        "reread_ratio": prompt / computed if computed else None,
        "ttft_mean_s": sum(r.ttft_s for r in rows) / len(rows),
        "last_turn_ttft_s": rows[-1].ttft_s,
        "session_s": wall_s,
        "vllm_metrics": metrics,
    }


class Restarted(NamedTuple):
    """A fresh vLLM server after a restart: its URL and the time from stopping the old one
    to the new one answering."""

    url: str
    restart_ready_s: float


Restart = Callable[[], Restarted]


WARM_SENDS = 3


@dataclass
class TTFTScenario:
    """S2: one long prompt sent cold, then again right away (warm), for each size.

    ``warm_s`` is the median of WARM_SENDS sends (one sample is at the mercy of whatever else
    the machine does at that moment); each is in ``warm_samples_s``.

    With ``restart``, vLLM is then restarted once (the kvkeep cache server keeps running) and
    every size is sent a third time: ``after_restart_s``, ``hit_rate_after_restart`` (cached
    prompt tokens over prompt tokens, less any kvkeep load that failed and was recomputed)
    and ``restart_ready_s``.
    """

    sizes: Sequence[int] = DEFAULT_TTFT_SIZES
    seed: int = 0
    name: str = "ttft"
    restart: bool = False
    # Distinct per scenario object, so that one run's canary is never another run's.
    _run_id: int = field(default_factory=time.time_ns)

    def tokens_needed(self) -> int:
        return max(self.sizes) + 64

    def run(self, url: str, restart: Restart | None = None) -> dict[str, Any]:
        return asyncio.run(self._run(url, restart if self.restart else None))

    async def _run(self, url: str, restart: Restart | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        prompts = {size: self._prompt(size, size) for size in self.sizes}
        async with httpx.AsyncClient() as client:
            model = await discover_model(client, url)
            # The first requests after a start are slow (and, with a connector, the first
            # load maps the arena); a canary of a few blocks takes those costs for every mode.
            await complete_ids(client, url, model, self._canary())
            await complete_ids(client, url, model, self._canary())
            for size in tqdm(self.sizes, desc="  ttft sizes", leave=False):
                ids = prompts[size]
                cold = await complete_ids(client, url, model, ids)
                warms = [await complete_ids(client, url, model, ids) for _ in range(WARM_SENDS)]
                warm_s = statistics.median(w.ttft_s for w in warms)
                out[str(size)] = {
                    "cold_s": cold.ttft_s,
                    "warm_s": warm_s,
                    "warm_samples_s": [w.ttft_s for w in warms],
                    "speedup": cold.ttft_s / warm_s if warm_s > 0 else None,
                    "cold_cached_tokens": cold.cached_tokens,
                    "warm_cached_tokens": min(w.cached_tokens for w in warms),
                    "prompt_tokens": cold.prompt_tokens,
                }
            if restart is not None:
                await self._after_restart(client, restart(), prompts, out)
        return {"sizes": out}

    async def _after_restart(
        self,
        client: httpx.AsyncClient,
        restarted: Restarted,
        prompts: dict[int, list[int]],
        out: dict[str, Any],
    ) -> None:
        """Send every prompt once more to the restarted server; adds the after-restart keys."""
        url = restarted.url
        model = await discover_model(client, url)
        await complete_ids(client, url, model, self._canary())  # loaded from kvkeep, if any
        for size, ids in prompts.items():
            before = kvkeep_load_counts(url)
            after = await complete_ids(client, url, model, ids)
            failed = kvkeep_load_counts(url)["load_failed"] - before["load_failed"]
            hits = max(after.cached_tokens - failed, 0)
            out[str(size)].update(
                after_restart_s=after.ttft_s,
                after_restart_cached_tokens=after.cached_tokens,
                hit_rate_after_restart=hits / after.prompt_tokens if after.prompt_tokens else None,
                restart_ready_s=restarted.restart_ready_s,
            )

    def _canary(self) -> list[int]:
        """A short prompt of full blocks plus a tail, the same for the whole run."""
        rng = random.Random(f"kvkeep-ttft-canary:{self.seed}:{self._run_id}")
        return [rng.randrange(100, 1000) for _ in range(4 * 128 + 16)]

    def _prompt(self, size: int, salt: int) -> list[int]:
        """Token ids unique to (seed, size, salt), so a cold prompt shares no prefix."""
        rng = random.Random(f"kvkeep-ttft:{self.seed}:{size}:{salt}:{time.time_ns()}")
        return [rng.randrange(100, 1000) for _ in range(size)]


_KVKEEP_TOKENS = re.compile(r'^vllm:kvkeep_tokens_total\{[^}]*op="(\w+)"[^}]*\}\s+(\S+)', re.M)


def kvkeep_load_counts(url: str) -> dict[str, float]:
    """kvkeep's own token counters from vLLM's /metrics (zeros when the connector is off)."""
    counts = {"offered": 0.0, "loaded": 0.0, "load_failed": 0.0, "saved": 0.0}
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for op, value in _KVKEEP_TOKENS.findall(text):
        counts[op] = counts.get(op, 0.0) + float(value)
    return counts


class _ModeRun:
    """One mode's vLLM server, restartable in place; ``close()`` stops it (idempotent)."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.server = VLLMServer(cfg).start()

    def restart(self) -> Restarted:
        t0 = time.monotonic()
        self.server.stop()
        self.server = VLLMServer(self.cfg).start()
        ready = time.monotonic() - t0
        print(f"  vLLM restarted, ready {ready:.1f} s after the stop began", file=sys.stderr)
        return Restarted(self.server.url, ready)

    def close(self) -> None:
        self.server.stop()


@contextlib.contextmanager
def _mode_server(cfg: LaunchConfig) -> Iterator[_ModeRun]:
    """vLLM in ``cfg.mode``; in mode kvkeep with a cache server that outlives restarts."""
    with contextlib.ExitStack() as stack:
        if cfg.mode == "kvkeep":
            socket_path = stack.enter_context(cache_server(cfg.cache_ram, cfg.cache_socket))
            cfg = replace(cfg, cache_socket=socket_path)
        run = _ModeRun(cfg)
        stack.callback(run.close)
        yield run


def run_modes(
    scenarios: Sequence[Scenario],
    modes: Sequence[str],
    base: LaunchConfig | None,
    endpoint: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every scenario on each mode; returns {scenario: {mode: result}}.

    With `endpoint`, the already-running server is measured once, under the mode name
    "endpoint". Otherwise vLLM is launched per mode from `base` and stopped afterwards.
    """
    out: dict[str, dict[str, Any]] = {s.name: {} for s in scenarios}
    if endpoint:
        for s in scenarios:
            out[s.name]["endpoint"] = s.run(endpoint.rstrip("/"))
        return out
    assert base is not None
    need = max(s.tokens_needed() for s in scenarios)
    cfg = replace(base, max_model_len=max(base.max_model_len, _round_up(need, 1024)))
    for i, mode in enumerate(modes):
        print(f"[{i + 1}/{len(modes)}] mode {mode}: {MODES[mode].description}", file=sys.stderr)
        with _mode_server(replace(cfg, mode=mode)) as run:
            server = run.server
            print(f"  vLLM ready in {server.ready_s:.1f} s at {server.url}", file=sys.stderr)
            for s in scenarios:
                if isinstance(s, TTFTScenario):
                    result = s.run(server.url, run.restart)
                else:
                    result = s.run(server.url)
                result["server"] = {
                    "ready_s": server.ready_s,
                    "log": str(run.server.log_path),
                    "reserved_cpus": cfg.reserved_cpus,
                }
                out[s.name][mode] = result
    return out


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def parse_modes(text: str) -> list[str]:
    """`none,vllm` -> ['none', 'vllm'], with a clear error for an unknown mode."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(MODES)}"
        )
    return modes


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        msg = f"--sizes wants integers like 4096,16384, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not sizes or min(sizes) < 16:
        raise argparse.ArgumentTypeError("--sizes wants token counts of at least 16")
    return sizes


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Arguments every scenario command shares: where to run and where to write."""
    p.add_argument(
        "--modes",
        type=parse_modes,
        default=["none", "vllm"],
        help=f"comma-separated cache modes to launch in turn ({', '.join(MODES)})",
    )
    p.add_argument("--endpoint", help="measure this running OpenAI-compatible server instead")
    p.add_argument(
        "--model",
        type=Path,
        default=Path(".cache/tiny-model"),
        help="model directory vLLM serves (default: the tiny model)",
    )
    p.add_argument("--kv-pool-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--num-blocks", type=int, help="--num-gpu-blocks-override for vLLM")
    p.add_argument("--max-num-batched-tokens", type=int, help="vLLM's chunked-prefill budget")
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=0,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU, pinned the same for every mode",
    )
    p.add_argument("--out", type=Path, help="write results.json, report.md and PNG plots here")
    p.add_argument("--json", type=Path, help="write only the JSON results to this file")
    p.add_argument("--log-dir", type=Path, default=Path(".cache/logs"))  # fmt: skip


def add_session_args(p: argparse.ArgumentParser) -> None:
    d = SessionSpec()
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument(
        "--final-context",
        type=int,
        default=d.final_context_tokens,
        help="last turn's context in tokens at --scale 1 (the study's 115k)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=DEFAULT_SCALE,
        help=f"multiply every size by this (default {DEFAULT_SCALE})",
    )
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tokenizer", type=Path,
                   help="tokenizer that sizes the turns (default: --model's)")  # fmt: skip


def session_spec(args: argparse.Namespace) -> SessionSpec:
    return SessionSpec(
        turns=args.turns,
        final_context_tokens=args.final_context,
        scale=args.scale,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed,
    )


def token_counter(args: argparse.Namespace) -> TokenCounter:
    """The model's own tokenizer when one is at hand, else a character estimate."""
    for path in (args.tokenizer, args.model):
        if path is not None and (path / "tokenizer.json" if path.is_dir() else path).is_file():
            return HFTokenizer(path)
    return CharEstimate()


def launch_config(args: argparse.Namespace) -> LaunchConfig | None:
    if args.endpoint:
        return None
    return LaunchConfig(
        model=args.model,
        kv_pool_gib=args.kv_pool_gib,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        reserved_cpus=args.reserved_cpus,
        log_dir=args.log_dir,
    )


def write_outputs(results: dict[str, Any], args: argparse.Namespace) -> None:
    """--json: the JSON alone; --out: JSON, report.md and plots. Prints the table either way."""
    results.setdefault("environment", environment(getattr(args, "model", None)))
    print(report.markdown(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"JSON written to {args.json}", file=sys.stderr)
    if args.out:
        paths = report.write_report(results, args.out)
        print(f"report written to {paths[0]} ({len(paths) - 1} more files)", file=sys.stderr)


def main(argv: list[str]) -> int:
    which, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"kvkeep bench {which}")
    add_common_args(p)
    if which == "session":
        add_session_args(p)
    else:
        p.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_TTFT_SIZES),
                       help="comma-separated prompt sizes in tokens")  # fmt: skip
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--restart", action="store_true",
                       help="restart vLLM after the warm pass; send every size again")  # fmt: skip
    args = p.parse_args(rest)
    try:
        scenario: Scenario
        if which == "session":
            scenario = SessionScenario(session_spec(args), token_counter(args))
        else:
            scenario = TTFTScenario(args.sizes, args.seed, restart=args.restart)
        by_scenario = run_modes([scenario], args.modes, launch_config(args), args.endpoint)
    except (ValueError, LaunchError, httpx.HTTPError) as exc:
        print(f"kvkeep bench {which}: {exc}", file=sys.stderr)
        return 1
    results = scenario_document(which, by_scenario[which], args)
    write_outputs(results, args)
    return 0


def scenario_document(name: str, modes: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON document of one scenario: `{"scenario": name, "modes": {...}, ...}`."""
    doc: dict[str, Any] = {"scenario": name, "modes": modes}
    if name == "session":
        doc["spec"] = asdict(session_spec(args))
    doc["setup"] = {
        "endpoint": args.endpoint,
        "model": str(args.model),
        "kv_pool_gib": args.kv_pool_gib,
        "num_blocks": args.num_blocks,
        "reserved_cpus": args.reserved_cpus,
        "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)},
    }
    if name == "ttft":
        doc["setup"]["restart"] = bool(getattr(args, "restart", False))
    return doc
