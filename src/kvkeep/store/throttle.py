"""Two small guards for a tier that talks to another process: a byte-rate token bucket and a
circuit breaker. Both are thread-safe bookkeeping; the caller decides what to do with them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """Bounds bytes per second: over any interval T at most ``burst + rate * T`` bytes pass.

    ``charge(n)`` takes ``n`` tokens at once and returns how long the caller must wait before
    sending; the bucket may go into debt, so a block larger than ``burst`` is still sent (after
    its wait) rather than starving forever. ``rate`` 0 means no limit: every wait is 0.
    """

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate < 0 or burst < 0:
            raise ValueError(f"rate and burst must be >= 0, got {rate} and {burst}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._last = burst, clock()
        self._lock = threading.Lock()

    def charge(self, n: int) -> float:
        """Take ``n`` tokens; seconds to wait before the ``n`` bytes may go. Never blocks."""
        if self.rate == 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            return max(0.0, -self._tokens / self.rate)


class Breaker:
    """Closed while calls succeed; after a failure, open (refuse at once) for a backoff that
    doubles per consecutive failure up to ``max_backoff_s``. The first call after the backoff
    is let through as a probe; its success closes the breaker again.

    This is what keeps a dead or hung remote store from costing a socket timeout per request.
    """

    def __init__(
        self,
        backoff_s: float,
        max_backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff_s, self.max_backoff_s, self._clock = backoff_s, max_backoff_s, clock
        self._failures = 0
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Whether a call may be tried now. No side effects."""
        return self._clock() >= self._retry_at

    @property
    def is_open(self) -> bool:
        return self._failures > 0

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._retry_at = 0.0

    def failure(self) -> bool:
        """Record a failure and open the breaker. True if it was closed until now."""
        with self._lock:
            self._failures += 1
            delay = min(self.backoff_s * 2 ** (self._failures - 1), self.max_backoff_s)
            self._retry_at = self._clock() + delay
            return self._failures == 1
