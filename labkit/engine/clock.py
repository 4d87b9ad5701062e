"""Engine clocks. The real executor measures wall time; the simulator advances virtual time by
the cost model's step time, so the same timestamps and metrics code serves both."""

from __future__ import annotations

import time


class WallClock:
    """Seconds since the engine started (time.perf_counter)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, dt: float) -> None:  # wall time advances by itself
        pass

    def advance_to(self, t: float) -> None:  # idle until t (nothing else to do)
        dt = t - self.now()
        if dt > 0:
            time.sleep(dt)


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)
