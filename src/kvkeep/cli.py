"""The `kvkeep` command line.

Each command lives in its own module with its own argument parser and a `main(argv) -> int`.
This file only routes `kvkeep COMMAND [SUB] ...` to that module, importing it lazily so that
`kvkeep --help` stays fast and no command pulls in another's dependencies.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple


class Route(NamedTuple):
    module: str
    help: str


# `kvkeep NAME ...` -> module whose main(argv) handles the rest of the arguments.
COMMANDS: dict[str, Route] = {
    "model": Route("kvkeep.tinymodel.generate", "generate the tiny local test model"),
    "demo": Route("kvkeep.demo", "the study's experiments, small, on the tiny local model"),
    "server": Route("kvkeep.server.main", "run the kvkeep cache server"),
    "serve": Route(
        "kvkeep.launch.serve", "start the cache server, then vLLM with the kvkeep connector"
    ),
    "plan": Route("kvkeep.plan.main", "which cache configuration a workload needs"),
    # listed here; `main` routes `kvkeep bench NAME` through BENCHES below
    "bench": Route("kvkeep.bench.cli", "the study's experiments side by side on real vLLM"),
}

# `kvkeep bench NAME ...` -> kvkeep.bench.cli, whose one parser handles every scenario. The
# names and help lines are the scenario descriptors' (`kvkeep.bench.scenarios.registry`), in
# their order, written out here so that `kvkeep bench --help` imports no scenario;
# tests/bench/test_registry.py holds this copy to them.
BENCHES: dict[str, Route] = {
    name: Route("kvkeep.bench.cli", help)
    for name, help in (
        ("session", "the study's 30-turn coding-agent session (S1)"),
        ("ttft", "one long prompt cold, then repeated (S2)"),
        ("capacity", "more documents than the device pool (S3)"),
        ("restart", "hits and TTFT after vLLM and cache restarts (S4)"),
        ("agents", "N concurrent closed-loop agents (S5)"),
        ("hol", "a cached request beside a large prefill (S6)"),
        ("replay", "real Claude Code sessions, closed loop (S7)"),
        ("soak", "agents while the cache and engine are killed"),
        ("store", "cache-server and tier bandwidth"),
        ("all", "the study's six experiments and S7 side by side: report.md, report.html, plots"),
    )
}


def _usage(table: dict[str, Route], prog: str) -> str:
    width = max(len(name) for name in table)
    rows = [f"  {name:<{width}}  {route.help}" for name, route in table.items()]
    return f"usage: {prog} COMMAND [ARGS...]\n\ncommands:\n" + "\n".join(rows) + "\n"


def _dispatch(table: dict[str, Route], prog: str, argv: list[str], pass_name: bool) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_usage(table, prog))
        return 0
    name, rest = argv[0], argv[1:]
    route = table.get(name)
    if route is None:
        sys.stderr.write(f"{prog}: unknown command {name!r}\n\n" + _usage(table, prog))
        return 2
    module = importlib.import_module(route.module)
    result: int = module.main([name, *rest] if pass_name else rest)
    return result


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        return _dispatch(BENCHES, "kvkeep bench", args[1:], pass_name=True)
    if args and args[0] == "--version":
        from kvkeep import __version__

        print(__version__)
        return 0
    return _dispatch(COMMANDS, "kvkeep", args, pass_name=False)


if __name__ == "__main__":
    raise SystemExit(main())
