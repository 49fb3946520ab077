"""The processes a bench run deploys, one handle each: `vllm.VLLMServer` (restartable in place),
`cache.CacheServer` (restart, SIGKILL, stats) and `cache.shared_store` (the Valkey/Redis that
replicas share). Every handle runs its process in its own session and stops it by process
group, so nothing outlives the bench; `exit_on_sigterm` makes a SIGTERM to the bench unwind
through those stops as Ctrl-C does.
"""

from __future__ import annotations

import signal
import threading


def exit_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt in this process, as Ctrl-C does.

    By default they end the process on the spot: no ``finally`` and no atexit, so every vLLM
    and cache server it started (each in its own session, out of reach of a signal to our
    group) would be left running. KeyboardInterrupt rather than SystemExit, because callers
    treat it as "stop everything": pytest ends the session (running fixture teardown) where
    it would record a SystemExit as one failed test and carry on. Only from the main thread,
    and only where no handler was installed; harmless to call again.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _interrupt_for_signal)


def _interrupt_for_signal(signum: int, frame: object) -> None:
    # A second signal while cleaning up must not cut the cleanup short; stop() is bounded.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
