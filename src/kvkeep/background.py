"""Background threads that give way to the engine.

kvkeep's background work (storing saved blocks, writing them through to the lower tiers,
refreshing hot prefixes) is never on a request's path, but it runs on the cores the engine
computes on. On a CPU engine every core is in the forward's thread team, so a background
thread that takes a core stalls the whole team until it yields. Under the ``idle`` policy
(the default) ``give_way`` puts the calling thread in Linux's SCHED_IDLE class: it runs only
on a core nothing else wants, so it uses the engine's idle moments and never preempts it.
Under ``normal``, or where the kernel has no SCHED_IDLE, it does nothing.

What it costs: while every core is busy, background work waits. Saves wait in the saver's
staging buffers (full buffers skip saves, counted); write-through waits in the store's queue
(a full queue drops writes to the lower tiers, counted; the block stays in RAM). The policy
is per process: the cache server sets it from ``--background``, the connector from its
``background`` setting.
"""

from __future__ import annotations

import os

POLICIES = ("idle", "normal")
_policy = "idle"


def check_policy(policy: str, what: str = "background policy") -> None:
    """Raise ValueError naming ``what`` and the choices unless ``policy`` is one."""
    if policy not in POLICIES:
        raise ValueError(f"{what} {policy!r}: choose one of {', '.join(POLICIES)}")


def set_policy(policy: str) -> None:
    """Set this process's policy; raises ValueError naming the choices."""
    global _policy
    check_policy(policy)
    _policy = policy


def give_way() -> bool:
    """Lower the calling thread to SCHED_IDLE under the ``idle`` policy; True if it now is."""
    if _policy != "idle":
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True
