"""The traffic simulator: users played through the real `openai` client against a serving endpoint.

Each simulated user has an API key of its own (`sk-sim-<user>`) and holds sessions
(`X-Session-ID`); a session asks `/v1/completions` to reverse a word (`rev abc=`, the prompt family
the demo's tiny model was warm-started on), judges the answer by a **hidden preference** the
prompt never states, may follow up in the same session (the next turn's prompt extends the
previous prompt and answer, so the endpoint records one growing sample), and posts its verdicts
to `POST /v1/feedback` (`key = "accepted"`, a bool per completion; source `user`).

Everything the simulator decides (users, words, follow-ups, the engine seed of every call) comes
from `random.Random` seeded by (`seed`, session number), so two runs with one seed ask the same
questions in the same sessions; what the model answers depends on the weights it is served with.

Preferences (`PREFERENCES`), measured on the default demo's warm-start (reverse, 3-letter words,
greedy train accuracy 0.21; seed 0; 400 prompts at temperature 0.7, max 12 tokens): every answer
stops cleanly (3 letters, a newline, eos: 100 %), the first letter is right 94 % of the time, the
last 72 %, the whole word 13.5 %. So "stops cleanly / is concise" cannot be a preference of this
model, and correctness alone is rarer than the 20-50 % the loop wants:

- `word_letters` (default, base rate 0.37): the user accepts an answer that uses only letters of
  the word asked about (no invented letters), right order or not. Correct answers pass, and so do
  near misses such as `aab` for `baa`.
- `correct` (0.135): the exact reversal.

429 answers (the endpoint's admission control while serving lags the learner) are retried by the
`openai` client itself after `Retry-After` (`max_retries`); the simulator counts them from the
HTTP responses it sees.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PREFERENCES: dict[str, tuple[str, Callable[[str, str], bool]]] = {
    "word_letters": (
        "the answer uses only letters of the word asked about",
        lambda word, answer: bool(answer) and set(answer) <= set(word),
    ),
    "correct": ("the answer is the word reversed", lambda word, answer: answer == word[::-1]),
}
FEEDBACK_KEY = "accepted"


@dataclass
class SimConfig:
    """What the simulated users do; every field has a default a demo can run with."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "slipstream-tiny"
    seed: int = 0
    users: int = 32
    """Distinct users (one API key each); a session belongs to user `session % users`."""
    concurrency: int = 16
    """Sessions in flight at once."""
    sessions_per_cycle: int = 64
    """Sessions `run_cycle` plays (the demo instead runs sessions until told to stop)."""
    max_turns: int = 2
    """Most calls in one session."""
    follow_up: float = 0.5
    """Chance that a user asks again (the same word: a dissatisfied re-ask) after a rejected answer."""
    next_question: float = 0.25
    """Chance that a user asks about another word after an accepted answer."""
    word_len: int = 3
    alphabet: str = string.ascii_lowercase
    preference: str = "word_letters"
    temperature: float = 0.7
    max_tokens: int = 8
    feedback: bool = True
    """Post each verdict to /v1/feedback (off: only implicit signals, from the follow-ups)."""
    max_retries: int = 60
    """The openai client's retries (429 with Retry-After included) before a call fails."""
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.preference not in PREFERENCES:
            raise ValueError(f"preference must be one of {sorted(PREFERENCES)}, got {self.preference!r}")
        if self.users < 1 or self.concurrency < 1 or self.max_turns < 1 or self.word_len < 1:
            raise ValueError("users, concurrency, max_turns and word_len must be >= 1")
        if not 0.0 <= self.follow_up <= 1.0 or not 0.0 <= self.next_question <= 1.0:
            raise ValueError("follow_up and next_question are probabilities in [0, 1]")


@dataclass
class Turn:
    """One call as the user saw it."""

    session_id: str
    user: int
    turn: int
    word: str
    answer: str
    accepted: bool
    version: int
    """Policy version of the answer's newest token (x-slipstream-policy-version)."""
    segments: list[list[int]]
    """Run-length [version, n_tokens] over the completion's tokens."""
    call_id: str
    sent_at: float
    """Unix time the request was sent (its first token is served after it)."""
    answered_at: float
    answer_ended: bool = True
    """The answer ended at the newline (finish_reason stop), not at max_tokens."""
    feedback: str = ""
    """The feedback route's answer: recorded, duplicate, or the error (empty when none was posted)."""


@dataclass
class SimStats:
    turns: list[Turn] = field(default_factory=list)
    sessions: int = 0
    failed_calls: int = 0
    errors: list[str] = field(default_factory=list)
    http_429: int = 0
    """429 answers seen (admission control); the client retried each after its Retry-After."""
    http_5xx: int = 0
    """Server errors seen (the client retries them too, with backoff)."""
    feedback_status: dict[str, int] = field(default_factory=dict)
    session_started: dict[str, float] = field(default_factory=dict)
    """Session id -> unix time its first request was sent."""

    def acceptance(self, version: int | None = None, *, first_turn_only: bool = False) -> tuple[float, int]:
        """(share of answers accepted, answers) over the answers served by `version` (None: all)."""
        rows = [
            t for t in self.turns if (version is None or t.version == version) and (not first_turn_only or t.turn == 0)
        ]
        return (sum(t.accepted for t in rows) / len(rows) if rows else 0.0), len(rows)


class Simulator:
    """Plays sessions against `config.base_url`; `run_cycle()` or `run_until(event)`."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = SimStats()
        self._accepts = PREFERENCES[config.preference][1]
        self._next_session = 0
        self._clients: dict[int, Any] = {}
        self._http: Any = None

    async def __aenter__(self) -> Simulator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _client(self, user: int) -> Any:
        import httpx2 as httpx
        import openai

        if self._http is None:

            async def count(response: httpx.Response) -> None:
                if response.status_code == 429:
                    self.stats.http_429 += 1
                elif response.status_code >= 500:
                    self.stats.http_5xx += 1

            self._http = httpx.AsyncClient(
                timeout=self.config.timeout_s,
                limits=httpx.Limits(max_connections=self.config.concurrency * 2),
                event_hooks={"response": [count]},
            )
        if user not in self._clients:
            self._clients[user] = openai.AsyncOpenAI(
                base_url=self.config.base_url,
                api_key=f"sk-sim-{user}",
                max_retries=self.config.max_retries,
                http_client=self._http,
            )
        return self._clients[user]

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        self._clients.clear()

    def _word(self, rng: random.Random) -> str:
        return "".join(rng.choice(self.config.alphabet) for _ in range(self.config.word_len))

    async def play_session(self, number: int) -> None:
        """Session `number`: its user, words, decisions and engine seeds follow from (seed, number)."""
        import openai

        cfg = self.config
        rng = random.Random(f"{cfg.seed}:{number}")
        user = number % cfg.users
        sid = f"sim{cfg.seed}-u{user}-s{number}"
        client = self._client(user)
        word = self._word(rng)
        context = ""
        self.stats.sessions += 1
        for turn in range(cfg.max_turns):
            prompt = f"{context}rev {word}="
            sent = time.time()
            self.stats.session_started.setdefault(sid, sent)
            try:
                raw = await client.completions.with_raw_response.create(
                    model=cfg.model,
                    prompt=prompt,
                    max_tokens=cfg.max_tokens,
                    temperature=cfg.temperature,
                    stop=["\n"],
                    seed=rng.randrange(2**31),
                    extra_headers={"X-Session-ID": sid},
                )
            except openai.APIError as exc:
                self.stats.failed_calls += 1
                if len(self.stats.errors) < 20:
                    self.stats.errors.append(f"{sid} turn {turn}: {exc}")
                return
            completion = raw.parse()
            answer = completion.choices[0].text
            extras = (completion.model_extra or {}).get("slipstream") or {}
            accepted = self._accepts(word, answer.strip())
            t = Turn(
                session_id=sid,
                user=user,
                turn=turn,
                word=word,
                answer=answer,
                accepted=accepted,
                version=int(raw.headers.get("x-slipstream-policy-version", "-1")),
                segments=[list(s) for s in extras.get("policy_segments") or []],
                call_id=str(extras.get("call_id") or completion.id.removeprefix("cmpl-")),
                sent_at=sent,
                answered_at=time.time(),
                answer_ended=completion.choices[0].finish_reason == "stop",
            )
            self.stats.turns.append(t)
            if cfg.feedback:
                t.feedback = await self._feedback(client, t)
            context = f"{prompt}{answer}\n"
            if accepted:
                if rng.random() >= cfg.next_question:
                    return
                word = self._word(rng)
            elif rng.random() >= cfg.follow_up:
                return

    async def _feedback(self, client: Any, t: Turn) -> str:
        import httpx2 as httpx
        import openai

        body = {
            "completion_id": t.call_id,
            "key": FEEDBACK_KEY,
            "value": t.accepted,
            "source": "user",
            "feedback_id": f"{t.call_id}:{FEEDBACK_KEY}",
        }
        try:
            resp = await client.post("/feedback", body=body, cast_to=httpx.Response)
            status = str(resp.json().get("status", "recorded"))
        except openai.APIStatusError as exc:
            status = f"http {exc.status_code}"
        except openai.APIError as exc:
            status = f"error {type(exc).__name__}"
        self.stats.feedback_status[status] = self.stats.feedback_status.get(status, 0) + 1
        return status

    async def run_cycle(self, sessions: int | None = None) -> SimStats:
        """Play `sessions` (default `sessions_per_cycle`) more sessions, `concurrency` at a time."""
        n = self.config.sessions_per_cycle if sessions is None else sessions
        numbers = iter(range(self._next_session, self._next_session + n))
        self._next_session += n

        async def lane() -> None:
            for number in numbers:
                await self.play_session(number)

        await asyncio.gather(*(lane() for _ in range(min(self.config.concurrency, n))))
        return self.stats

    async def run_until(self, stop: asyncio.Event) -> SimStats:
        """Play sessions, `concurrency` at a time, until `stop` is set (sessions under way finish)."""

        async def lane() -> None:
            while not stop.is_set():
                number = self._next_session
                self._next_session += 1
                await self.play_session(number)

        await asyncio.gather(*(lane() for _ in range(self.config.concurrency)))
        return self.stats
