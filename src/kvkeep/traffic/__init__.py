"""Workload traffic that bench and plan share: agent sessions and the endpoint they go to.

Agent workloads (turns, documents, traces) and the OpenAI endpoint they are sent to.
"""
