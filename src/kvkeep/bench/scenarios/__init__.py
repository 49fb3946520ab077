"""One module per `kvkeep bench` experiment, each a `Scenario` with its own arguments.

    session   S1: one coding-agent session, turn by turn
    ttft      S2: one long prompt cold, then again (`--restart`: and after a vLLM restart)
    capacity  S3: more documents than the device pool, in tile order
    restart   S4: hits after vLLM and cache-server restarts (`--remote`: a host replaced)
    agents    S5: N closed-loop agents (`--replicas`: routed over replicas)
    hol       S6: a cached request beside a large prefill
    soak      agents while the cache server is killed and vLLM restarted
    store     the cache server's bandwidth and latency, no vLLM

Each module offers ``add_args(parser)`` and ``build(args) -> list[Scenario]`` (raising
ValueError for bad arguments), which `bench/cli.py` registers, and defines the frozen result
dataclass its scenario's ``run`` returns; the field names are the keys of `results.json`.
"""
