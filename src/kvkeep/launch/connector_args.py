"""The vLLM arguments that load kvkeep's connector: ``--kv-transfer-config`` for a socket.

Pure, and nothing here imports vllm: `kvkeep serve`, the bench launcher and the tests build
their engine command lines from it. ``CONNECTOR_MODULE`` is the module vLLM imports in its
engine and worker processes (`kvkeep.vllm.connector`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

CONNECTOR_CLASS = "KVKeepConnector"
CONNECTOR_MODULE = "kvkeep.vllm.connector"


def kv_transfer_config(
    socket_path: str,
    timeout_s: float = 1.0,
    audit: bool = False,
    more: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for the kvkeep connector. Pure. ``audit`` turns on
    the connector's debug comparison of recomputed blocks with their stored copies; ``more``
    adds other connector settings (``kvkeep.vllm.config.ConnectorConfig`` checks them)."""
    extra: dict[str, object] = {"socket": socket_path, "timeout_s": timeout_s, **(more or {})}
    if audit:
        extra["audit"] = True
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def kv_transfer_args(
    socket_path: str,
    timeout_s: float = 1.0,
    audit: bool = False,
    more: Mapping[str, object] | None = None,
) -> list[str]:
    """The vLLM arguments that load the kvkeep connector. Pure."""
    config = kv_transfer_config(socket_path, timeout_s, audit, more)
    text = json.dumps(config, separators=(",", ":"))
    return ["--kv-transfer-config", text]
