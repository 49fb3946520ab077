"""Traffic that bench and plan share.

Agent workloads (turns, documents, traces) and the OpenAI endpoint they are sent to.
"""
