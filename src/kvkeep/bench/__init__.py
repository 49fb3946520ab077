"""The measuring instrument: `kvkeep bench`, the study's experiments on real vLLM.

Every experiment is a `scenario.Scenario` (in `scenarios/`) that says what it needs and
measures one mode through a `context.RunContext`, returning a frozen result dataclass;
`suite.run_modes` is the one loop that deploys each mode (`deploy/`: vLLM, the cache server,
the shared store), runs them and turns each result into JSON (`result.to_json`); `cli.py` is
the one parser, its commands declared once per scenario module (`command.Command`, listed
in `scenarios/registry.py`); `report/` turns the JSON into tables, plots and HTML.
"""
