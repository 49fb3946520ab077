"""One module per `kvkeep bench` experiment (`kvkeep bench --help` lists them).

Each module offers ``add_args(parser)`` and ``build(args) -> list[Scenario]`` (raising
ValueError for bad arguments), which `bench/cli.py` registers, and defines the frozen result
dataclass its scenario's ``run`` returns; the field names are the keys of `results.json`.
"""
