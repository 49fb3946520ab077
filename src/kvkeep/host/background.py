"""Background work that gives way to the engine: idle priority, CPU binding, thread names.

``give_way`` puts the calling thread in Linux's SCHED_IDLE class under the ``idle`` policy
(the default; the cache server sets it from ``--background``), so it runs only on cores
nothing else wants; under ``normal``, or without SCHED_IDLE, it does nothing. It is for work
never on a request's path: the cache server's write-through to its disk and remote tiers, and
populating a client's arena mapping. Saves and touches keep the engine's priority.

``unbind`` gives the data path's threads (saver, loader) the CPUs of the process that started
the worker (a user's ``taskset`` still holds), not the one core they would inherit from vLLM's
worker thread. Every kvkeep thread is started by ``start_thread``, which names it in the
kernel too (``kvkeep-save``, ``kvkeep-writer``, ...).
What giving way costs, and why threads are bound as they are: docs/notes/background-work.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from typing import Any

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


def unbind() -> bool:
    """Let the calling thread run on the CPUs of this process's parent (the set it was started
    with, before a CPU engine bound its threads to single cores); True if that changed its
    set. Nothing where the platform has no CPU affinity."""
    try:
        allowed = os.sched_getaffinity(os.getppid())
        if allowed == os.sched_getaffinity(0):
            return False
        os.sched_setaffinity(0, allowed)
    except (AttributeError, OSError):
        return False
    return True


def start_thread(target: Callable[..., object], name: str, *args: Any) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread named ``name``, in Python and in the kernel
    (Linux keeps 15 bytes of it); returns the started thread."""

    def run() -> None:
        set_os_name(name)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


_PR_SET_NAME = 15
_libc: Any = None


def set_os_name(name: str) -> bool:
    """Name the calling thread in the kernel (``/proc/self/task/*/comm``); True if it took.
    Nothing off Linux."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
