"""kvkeep's vLLM adapter: the KV connector, and the only package that imports vllm.

Only ``connector`` and ``compat`` import it: ``config``, ``plan``, ``book``, ``guard`` and
``layout`` are pure and import without vllm installed.
"""
