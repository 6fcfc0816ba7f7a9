"""Restarting crashed services as a cluster restarts a pod: backoff, a crash budget, counts and events.

`Supervisor` is bookkeeping only (no processes, no sockets): the stack tells it that a service
exited and asks which restarts are due; it decides, counts restarts per service and keeps an
event log that `slipstream up`, `demo` / `train` (live view and summary), `slipstream status`
(through stack.json) and the chaos suite read. The policy follows Kubernetes' `OnFailure`
restart policy with its crash-loop backoff, on a laptop's time scale:

- exit 0: the service finished on purpose (the learner at max_steps): it stays down;
- exit 2: a configuration error (the runtime's exit code for one): restarting cannot help, so
  the supervisor gives up at once and says so;
- any other exit, or death by a signal (SIGKILL, the OOM killer): restarted after
  `backoff_s * 2**k` seconds (capped at `max_backoff_s`), k = the service's crashes in the last
  `window_s` seconds before this one;
- a crash when `max_restarts` restarts already happened within `window_s`: give up, with a
  message naming the service, how often it crashed and its last exit code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

EXIT_CONFIG = 2
"""A service's exit code for bad configuration (argparse and the runtime's config loader)."""

EventKind = Literal["crashed", "restarted", "finished", "gave_up"]


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a crashed service is started again."""

    enabled: bool = True
    backoff_s: float = 1.0
    """Wait before the first restart; doubles with each crash inside the window."""
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    """Restarts allowed within `window_s`; the next crash gives up."""
    window_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("backoff_s", "max_backoff_s", "window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"RestartPolicy.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"RestartPolicy.max_restarts must be >= 0, got {self.max_restarts}")

    def delay(self, recent_crashes: int) -> float:
        """Backoff before the restart that follows the (recent_crashes + 1)-th crash in the window."""
        return float(min(self.max_backoff_s, self.backoff_s * (2 ** min(recent_crashes, 30))))


NO_RESTART = RestartPolicy(enabled=False)


def describe_exit(code: int | None) -> str:
    """`exit code 1`, `killed by SIGKILL`, or `still running`."""
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class SupervisorEvent:
    """One thing the supervisor saw or did, for the live view, the logs and the run summary."""

    service: str
    kind: EventKind
    exit_code: int | None
    restarts: int
    """Restarts of this service so far (after this event)."""
    at: float
    """Wall-clock time (time.time())."""
    detail: str = ""

    def message(self) -> str:
        if self.kind == "crashed":
            return f"{self.service} crashed ({describe_exit(self.exit_code)}); {self.detail}"
        if self.kind == "restarted":
            return f"{self.service} restarted (restart {self.restarts}{', ' + self.detail if self.detail else ''})"
        if self.kind == "finished":
            return f"{self.service} finished (exit code 0)"
        return f"{self.service} gave up: {self.detail}"

    def as_dict(self) -> dict[str, object]:
        return {
            "service": self.service,
            "kind": self.kind,
            "exit_code": self.exit_code,
            "restarts": self.restarts,
            "at": round(self.at, 3),
            "detail": self.detail,
        }


@dataclass
class _Track:
    crashes: list[float] = field(default_factory=list)  # monotonic times of crashes in the window
    restarts: int = 0
    due_at: float | None = None
    state: Literal["running", "backoff", "finished", "gave_up", "retired"] = "running"
    last_exit: int | None = None
    gave_up: str = ""


class Supervisor:
    """Restart decisions and counts for a set of named services (see the module docstring)."""

    def __init__(
        self,
        policy: RestartPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_event: Callable[[SupervisorEvent], None] | None = None,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._wall = wall
        self._on_event = on_event
        self._tracks: dict[str, _Track] = {}
        self.events: list[SupervisorEvent] = []

    def _track(self, name: str) -> _Track:
        return self._tracks.setdefault(name, _Track())

    def _emit(self, name: str, kind: EventKind, code: int | None, detail: str = "") -> SupervisorEvent:
        ev = SupervisorEvent(name, kind, code, self._track(name).restarts, self._wall(), detail)
        self.events.append(ev)
        if self._on_event is not None:
            self._on_event(ev)
        return ev

    # -- what the stack reports --------------------------------------------------------------------
    def exited(self, name: str, code: int | None) -> SupervisorEvent:
        """A service process ended with `code`; returns the decision as an event.

        `crashed` means a restart is scheduled (see `due`); `finished` and `gave_up` are final.
        """
        t = self._track(name)
        t.last_exit = code
        now = self._clock()
        if code == 0:
            t.state, t.due_at = "finished", None
            return self._emit(name, "finished", code)
        if code == EXIT_CONFIG:
            t.state, t.due_at = "gave_up", None
            t.gave_up = (
                f"{name} exited with {describe_exit(code)} (a configuration error); not restarted, "
                "since restarting cannot fix it"
            )
            return self._emit(name, "gave_up", code, t.gave_up)
        t.crashes = [c for c in t.crashes if now - c < self.policy.window_s]
        recent = len(t.crashes)
        t.crashes.append(now)
        if recent >= self.policy.max_restarts:
            t.state, t.due_at = "gave_up", None
            t.gave_up = (
                f"{name} crashed {recent + 1} times within {self.policy.window_s:.0f} s "
                f"(last: {describe_exit(code)}) after {t.restarts} restart(s); not restarting it again"
            )
            return self._emit(name, "gave_up", code, t.gave_up)
        delay = self.policy.delay(recent)
        t.state, t.due_at = "backoff", now + delay
        return self._emit(name, "crashed", code, f"restarting in {delay:.1f} s")

    def due(self) -> list[str]:
        """Services whose backoff has passed: the caller restarts them and calls `restarted`."""
        now = self._clock()
        return [n for n, t in self._tracks.items() if t.state == "backoff" and t.due_at is not None and t.due_at <= now]

    def restarted(self, name: str, detail: str = "") -> SupervisorEvent:
        t = self._track(name)
        t.restarts += 1
        t.state, t.due_at = "running", None
        return self._emit(name, "restarted", t.last_exit, detail)

    def retire(self, name: str) -> None:
        """The service is being stopped on purpose: whatever it exits with, it stays down."""
        t = self._track(name)
        if t.state in ("running", "backoff"):
            t.state, t.due_at = "retired", None

    # -- what the views read -----------------------------------------------------------------------
    def restarts(self, name: str) -> int:
        return self._tracks[name].restarts if name in self._tracks else 0

    def counts(self) -> dict[str, int]:
        """Restarts per service (every service the supervisor has heard of, zeros included)."""
        return {n: t.restarts for n, t in self._tracks.items()}

    def state(self, name: str) -> str:
        return self._tracks[name].state if name in self._tracks else "running"

    def restart_in(self, name: str) -> float | None:
        """Seconds until a scheduled restart, or None."""
        t = self._tracks.get(name)
        if t is None or t.state != "backoff" or t.due_at is None:
            return None
        return max(0.0, t.due_at - self._clock())

    def gave_up(self, name: str) -> str:
        """Why the supervisor gave up on `name` ('' when it did not)."""
        t = self._tracks.get(name)
        return t.gave_up if t is not None else ""

    def last_exit(self, name: str) -> int | None:
        t = self._tracks.get(name)
        return t.last_exit if t is not None else None

    def watch(self, name: str) -> None:
        """Start counting `name` (so it shows with 0 restarts)."""
        self._track(name)
