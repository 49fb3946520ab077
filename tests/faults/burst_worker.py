"""A client process for the kill test: two threads sharing one client write and read back
blocks until a stop file appears, then report what every call did as JSON.

Run as ``python burst_worker.py SOCKET WORKER_ID STOP_FILE OUT_FILE``. It imports only kvkeep, so
it runs outside pytest. A served block must equal ``payload(key)`` byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvkeep.keys import Namespace, chain_keys
from kvkeep.server.client import CacheUnavailable, KVKeepClient
from kvkeep.store.base import checksum

NS = Namespace("tiny-model", "bfloat16", "LBHNC", "cpu", block_size=16)
BLOCK = 64 * 1024
BATCH = 4
TIMEOUT_S = 1.0


def payload(key: bytes) -> np.ndarray:
    return np.resize(np.frombuffer(hashlib.sha256(key).digest(), dtype=np.uint8), BLOCK)


class Report:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok: list[float] = []  # times of successful calls
        self.unavailable = 0
        self.other: list[str] = []  # any other exception: must stay empty
        self.bad_blocks = 0  # served bytes that were not the key's payload
        self.served = 0
        self.slowest = 0.0

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        try:
            result = fn(*args)
        except CacheUnavailable:
            with self.lock:
                self.unavailable += 1
            return None
        except Exception as exc:
            with self.lock:
                self.other.append(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            with self.lock:
                self.slowest = max(self.slowest, time.monotonic() - started)
        with self.lock:
            self.ok.append(time.time())
        return result


def store(client: KVKeepClient, session, batch) -> None:  # type: ignore[no-untyped-def]
    slots = client.reserve(session, batch)
    for slot in slots:
        client.slot_view(slot)[:] = payload(slot.key)
    client.commit(session, slots, [checksum(payload(s.key).data) for s in slots])


def read(client: KVKeepClient, session, batch, report: Report) -> None:  # type: ignore[no-untyped-def]
    slots = client.acquire(session, batch)
    try:
        for slot in slots:
            good = (
                client.verify(slot) and bytes(client.slot_view(slot)) == payload(slot.key).tobytes()
            )
            with report.lock:
                report.served += 1
                report.bad_blocks += not good
    finally:
        client.release(slots)


def run(client: KVKeepClient, lane: int, stop: Path, report: Report) -> None:
    session = client.session(NS, BLOCK)
    rng = random.Random(lane)
    written: list[list[bytes]] = []
    i = 0
    while not stop.exists():
        batch = chain_keys(NS, list(range(lane * 10**7 + i * 64, lane * 10**7 + (i + 1) * 64)), 16)
        i += 1
        report.call(store, client, session, batch)
        written.append(batch)  # even if the call failed: whatever is served gets checked
        report.call(read, client, session, rng.choice(written), report)
        time.sleep(0.005)


def main() -> None:
    socket_path, worker, stop, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    client = KVKeepClient(socket_path, timeout_s=TIMEOUT_S, max_backoff_s=0.2)
    report = Report()
    threads = [
        threading.Thread(target=run, args=(client, worker * 2 + t, stop, report)) for t in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps(report.__dict__ | {"lock": None}))


if __name__ == "__main__":
    main()
