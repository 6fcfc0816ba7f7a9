"""SIGINT / SIGTERM / SIGHUP handling for commands that own a stack, and the flag the waits poll.

The first signal asks for an orderly stop (the command's wait loops see the flag and return);
a second one makes the stop in progress SIGKILL at once. Handlers only flip flags: printing or
taking locks inside a handler can deadlock the code it interrupted.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopFlag:
    """Set from a signal handler, polled by the waits.

    Not a threading.Event: Event.set() takes a non-reentrant lock, which a handler running on
    top of Event.wait() in the same thread can deadlock on.
    """

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True if the flag was (or got) set."""
        deadline = time.monotonic() + seconds
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(0.05, left))
        return self._set


class StopSignals:
    """Context manager: route stop signals to a stack while active, restore the old handlers after.

    The first signal sets `interrupt` (the stack's waits poll it); a later one calls `force_stop`.
    """

    def __init__(self, interrupt: StopFlag, force_stop: Callable[[], None]) -> None:
        self.interrupt = interrupt
        self.force_stop = force_stop
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.interrupt.is_set():
            self.force_stop()
        self.interrupt.set()

    def __enter__(self) -> StopSignals:
        for sig in SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
