"""`guess`: a small OpenEnv environment, served by openenv-core's own server code.

The agent guesses a hidden letter from a short alphabet; after a wrong guess the server answers
"later" or "earlier" (alphabet order) and the agent guesses again, up to `MAX_GUESSES`. Each
step's reward: 1.0 for the right letter; for a wrong one, `near` = 0.1 * (1 - |code of the
guess's first character - code of the letter| / 256), a shaped signal that differs between any
two different guesses (so even a model that never names the letter sees some guesses beat
others); 0 for an empty guess. The hidden
letter is a pure function of the reset seed, so Slipstream's `openenv` environment (a task is a
seed) replays a task exactly.

Run it alone:  python examples/openenv-guess/guess_server.py --port 8001
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app

ALPHABET = "abcdefgh"
MAX_GUESSES = 3


def near_reward(guess: str, secret: str) -> float:
    """A wrong guess's reward: 0.1 at the letter's code, falling linearly with the distance."""
    return 0.1 * (1.0 - abs(ord(guess) - ord(secret)) / 256) if guess else 0.0


class GuessAction(Action):
    """One guess: the model's text (its first letter counts)."""

    message: str


class GuessObservation(Observation):
    """What the agent reads next: the prompt (the task, then feedback on each guess)."""

    prompt: str


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """The hidden letter is seed-determined; feedback says which way to move."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self._secret = ALPHABET[0]

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).choice(ALPHABET)
        self._state = State(episode_id=episode_id or f"guess-{seed}", step_count=0)
        prompt = f"Guess the hidden letter, one of {ALPHABET}. Answer with one letter.\nGuess: "
        return GuessObservation(prompt=prompt, done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        guess = action.message.strip()[:1].lower()
        if guess == self._secret:
            return GuessObservation(prompt="Right.\n", done=True, reward=1.0)
        near = near_reward(guess, self._secret)
        if self._state.step_count >= MAX_GUESSES:
            return GuessObservation(prompt=f"No, it was {self._secret}.\n", done=True, reward=near)
        hint = "later" if guess and guess < self._secret else "earlier"
        if guess not in ALPHABET:
            hint = f"not a letter of {ALPHABET}"
        return GuessObservation(prompt=f"\nNo: {hint}.\nGuess: ", done=False, reward=near)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
