"""One module per `kvkeep bench` experiment (`kvkeep bench --help` lists them).

Each module exports one ``COMMAND`` (`kvkeep.bench.command.Command`: its ``add_args(parser)``
and ``build(args) -> list[Scenario]``, raising ValueError for bad arguments; its report
sections, claims and part of `bench all`), listed once in `registry`, and defines the frozen
result dataclass its scenario's ``run`` returns; the field names are the keys of
`results.json` (`kvkeep.bench.result`: ``to_json`` and ``from_json``).
"""
