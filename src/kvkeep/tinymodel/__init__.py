"""Tiny test models: the small context-reading models that tests and the demo run.

Config, byte-level BPE tokenizer and seeded weights that read their context, per architecture.
"""
