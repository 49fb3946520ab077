"""The tiny models tests and the demo run.

Config, byte-level BPE tokenizer and seeded weights that read their context, per architecture.
"""
