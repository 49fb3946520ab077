"""The write-through's gate: busy while the rest of the machine leaves no core idle."""

from __future__ import annotations

import time

from kvkeep.store.idlegate import CpuSample, IdleGate, read_cpu


class Machine:
    """A /proc/stat that the test moves: ``others`` cores busy, ``own`` the writer's."""

    def __init__(self, others: float, own: float = 0.0) -> None:
        self.others, self.own = others, own
        self.t0 = time.monotonic()

    def __call__(self) -> CpuSample:
        dt = time.monotonic() - self.t0
        return CpuSample((self.others + self.own) * dt, self.own * dt, self.t0 + dt)


def test_two_busy_cores_of_two_hold_the_writer_until_max_wait() -> None:
    gate = IdleGate(window_s=0.01, max_wait_s=0.2, sample=Machine(others=2.0), cores=2)
    t0 = time.monotonic()
    gate.wait(lambda: False)
    assert 0.2 <= time.monotonic() - t0 < 1.0 and gate.waited_s >= 0.2


def test_a_spare_core_or_a_hurry_lets_it_write_at_once() -> None:
    # the writer's own busy core is not the machine's: one other core busy leaves one idle
    idle = IdleGate(window_s=0.01, max_wait_s=5, sample=Machine(others=1.0, own=1.0), cores=2)
    busy = IdleGate(window_s=0.01, max_wait_s=5, sample=Machine(others=2.0), cores=2)
    time.sleep(0.02)
    t0 = time.monotonic()
    idle.wait(lambda: False)
    busy.wait(lambda: True)
    assert time.monotonic() - t0 < 0.1


def test_this_machine_can_be_read() -> None:
    sample = read_cpu()
    assert sample is not None and sample.busy_s > 0
    assert read_cpu("/nonexistent/stat") is None
