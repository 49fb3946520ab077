"""The measuring instrument: `kvkeep bench`, the study's experiments on real vLLM.

Every experiment is a `scenario.Scenario` (in `scenarios/`) that says what it needs and
measures one mode through a `context.RunContext`; `suite.run_modes` is the one loop that
deploys each mode (`deploy/`: vLLM, the cache server, the shared store) and runs them;
`cli.py` is the one parser; `report/` turns the results into tables, plots and HTML.
"""
