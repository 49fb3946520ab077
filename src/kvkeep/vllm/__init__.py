"""kvkeep's vLLM adapter. The only package that imports vllm, and only in ``connector`` and
``compat``: ``config``, ``plan``, ``book``, ``guard`` and ``layout`` are pure and import
without vllm installed."""
