"""Launching vLLM with kvkeep: `kvkeep serve` and the cache-server process.

`kvkeep serve`, the cache-server process, the connector's vLLM arguments, and the checks of the
installed vLLM and the model before start.
"""
