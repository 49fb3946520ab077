"""`kvkeep demo` (what `make demo` runs): the instrument end to end on the tiny local model.

It generates the tiny model if it is missing, then runs the coding-agent session (S1) and the
TTFT scenario (S2) in each cache mode, prints the side-by-side table, and writes the report,
JSON and plots. Nothing is downloaded. On 2 cores it finishes within about 10 minutes.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from kvkeep.bench import report
from kvkeep.bench.launch import LaunchConfig, LaunchError
from kvkeep.bench.scenarios import Scenario, SessionScenario, TTFTScenario, parse_modes, run_modes
from kvkeep.bench.workload import HFTokenizer, SessionSpec
from kvkeep.model import TinyModelSpec, write_tiny_model

DEMO_TTFT_SIZES = (2048, 8192)
# Smaller than the bench's default scale so that both modes, two vLLM starts and the TTFT
# scenario fit in about 5 minutes on 2 cores.
DEMO_SCALE = 0.25


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvkeep demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path(".cache/tiny-model"))
    p.add_argument("--out", type=Path, default=Path("kvkeep-report"))
    p.add_argument("--modes", type=parse_modes, default=["none", "vllm"])
    p.add_argument("--scale", type=float, default=DEMO_SCALE)
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"generating the tiny model in {args.model}", file=sys.stderr)
        write_tiny_model(args.model, TinyModelSpec())
    spec = SessionSpec(scale=args.scale)
    scenarios: list[Scenario] = [
        SessionScenario(spec, HFTokenizer(args.model)),
        TTFTScenario(DEMO_TTFT_SIZES),
    ]
    t0 = time.monotonic()
    try:
        results = run_modes(scenarios, args.modes, LaunchConfig(model=args.model))
    except (LaunchError, httpx.HTTPError, ValueError) as exc:
        print(f"kvkeep demo: {exc}", file=sys.stderr)
        return 1
    wall_s = time.monotonic() - t0
    doc: dict[str, object] = {
        "scenarios": {
            "session": {"scenario": "session", "modes": results["session"], "spec": asdict(spec)},
            "ttft": {"scenario": "ttft", "modes": results["ttft"]},
        },
        "wall_s": wall_s,
    }
    print(report.markdown(doc))
    paths = report.write_report(doc, args.out)
    print(f"Finished in {wall_s / 60:.1f} min. Report: {paths[0]}")
    print("Plots: " + ", ".join(str(p) for p in paths[2:]))
    return 0
