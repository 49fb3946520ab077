"""kvkeep's vLLM adapter. The only package that imports vllm, and only in ``connector`` and
``compat``: ``scheduling`` and ``layout`` are pure and import without vllm installed."""
