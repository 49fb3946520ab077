"""kvkeep: a KV cache for LLM coding agents, kept outside the engine."""

__version__ = "0.1.0"
