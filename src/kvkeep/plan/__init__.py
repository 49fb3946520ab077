"""`kvkeep plan`: which cache tiers a workload needs, how big, and what hit rate to expect.

- :mod:`.footprint`: KV bytes per token of a model (config.json or a preset with sources);
- :mod:`.trace`, :mod:`.workloads`, :mod:`.claude_code`: workloads as block traces;
- :mod:`.replay`: what `kvkeep bench replay` sends, as tokens and as a block trace;
- :mod:`.stackdist`: exact LRU stack distances, one pass, every capacity;
- :mod:`.tiers`, :mod:`.cost`: hit rates per tier, TTFT and turns/min;
- :mod:`.main`: the command line, the recommendation and the plot.
"""
