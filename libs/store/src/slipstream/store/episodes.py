"""Episode bodies by reference: an episode too big for the bus goes to the object store first.

NATS moves messages, the object store holds bytes. A producer calls `offload` before publishing:
an episode whose encoded size fits the bus limit is returned unchanged; a bigger one is written
under `episode_key(...)` and replaced by its stub (every header field, no samples or tool log,
`body_ref` = key, size, sha256). Consumers call `load` (or `load_scored`) before they need tokens:
it fetches the body, checks its size and sha256 and that it is the episode the stub names.
Scoring never rewrites the body, so a scored stub keeps pointing at the same object.

These functions block (object-store I/O); asyncio code runs them through `asyncio.to_thread`.
"""

from __future__ import annotations

import hashlib

import msgspec

from slipstream.schemas import Episode, EpisodeRef, SchemaError, ScoredEpisode, decode, encode, stub_of
from slipstream.store.protocol import ObjectStore

# What a stub's headers and fields may add on top of the limit we compare the body against.
HEADROOM = 8192


class EpisodeBodyError(ValueError):
    """A stored body is missing its promise: wrong size, wrong sha256, undecodable or another episode."""


def episode_key(run_id: str, episode_id: str) -> str:
    """Where the body of an episode lives: `<run>/episodes/<episode id>.msgpack`."""
    return f"{run_id or 'default'}/episodes/{episode_id}.msgpack"


def offload(store: ObjectStore, episode: Episode, limit: int) -> Episode:
    """`episode` itself when it encodes to at most `limit` − HEADROOM bytes, else its stub (body stored first)."""
    if episode.is_stub():
        return episode
    body = encode(episode)
    if len(body) <= limit - HEADROOM:
        return episode
    key = episode_key(episode.run_id, episode.episode_id)
    store.put(key, body)
    ref = EpisodeRef(
        key=key,
        size=len(body),
        sha256=hashlib.sha256(body).hexdigest(),
        n_samples=len(episode.samples),
        n_tokens=episode.n_tokens(),
        oldest_version=episode.oldest_version(),
    )
    return stub_of(episode, ref)


def load(store: ObjectStore, episode: Episode) -> Episode:
    """The full episode: `episode` itself unless it is a stub, else its stored body, verified.

    Raises `ObjectNotFound` when the body is gone and `EpisodeBodyError` when it is not the
    body the stub promised.
    """
    ref = episode.body_ref
    if ref is None:
        return episode
    body = store.get(ref.key)
    if len(body) != ref.size:
        raise EpisodeBodyError(f"body {ref.key!r} is {len(body)} bytes, its stub says {ref.size}")
    digest = hashlib.sha256(body).hexdigest()
    if digest != ref.sha256:
        raise EpisodeBodyError(f"body {ref.key!r} has sha256 {digest}, its stub says {ref.sha256}")
    try:
        full = decode(body, Episode)
    except SchemaError as exc:
        raise EpisodeBodyError(f"body {ref.key!r} does not decode: {exc}") from exc
    if full.episode_id != episode.episode_id:
        raise EpisodeBodyError(f"body {ref.key!r} holds episode {full.episode_id!r}, not {episode.episode_id!r}")
    return full


def load_scored(store: ObjectStore, scored: ScoredEpisode) -> ScoredEpisode:
    """`scored` with its episode's body loaded (unchanged when it carried the body inline)."""
    if not scored.episode.is_stub():
        return scored
    return msgspec.structs.replace(scored, episode=load(store, scored.episode))
