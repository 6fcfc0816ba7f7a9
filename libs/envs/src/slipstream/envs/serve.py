"""`serve`: scores served traffic by its feedback, through a declarative, versioned reward spec.

Episodes recorded by the OpenAI-compatible endpoint (libs/serve) carry the signals posted or
implied after the fact (`Episode.feedback`: key, value, source). This environment has no tasks
of its own; in the reward-model it turns those signals into named reward components with the
spec given as its options (`[reward] env_options = {serve = {version = ..., components = [...]}}`):

```toml
[reward.env_options.serve]
version = "thumbs-v2"
components = [
  {name = "accepted", signal = "accepted", map = {true = 1.0, false = 0.0}},
  {name = "dissatisfied", signal = "dissatisfied", scale = -0.5},
  {name = "latency", signal = "latency_s", scale = -0.01, offset = 0.1, default = 0.0},
]
```

A component reads the latest signal with its key (from `source` only, when set): a `map` turns a
label into a number (booleans are `true` / `false`, numbers written as `1`, `0.5`), otherwise the
number is `scale * value + offset` (a boolean counts as 1 / 0; a label without a map entry, or a
string without a map, counts as absent). It contributes `weight * number`; an absent signal
contributes `weight * default`, or nothing when the component has no default. The reward is the
sum of the named components. An episode none of whose signals the spec uses is *masked*
(`Score.unscorable`), never scored 0. `scorer_version` names the spec's version, so a changed
spec never mixes silently with rewards from the old one.
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import Annotated, ClassVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec
from slipstream.envs.registry import register
from slipstream.schemas import Episode, FeedbackSignal

Doc = msgspec.Meta


class RewardComponent(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One named component of the reward, read from one feedback signal."""

    name: Annotated[str, Doc(description="Component name (ScoredEpisode.components key).")]
    signal: Annotated[str, Doc(description="The feedback key it reads.")]
    map: Annotated[
        dict[str, float], Doc(description="Label -> number ('true'/'false' for booleans, numbers as written).")
    ] = {}
    scale: Annotated[float, Doc(description="Without a map: number = scale * value + offset.")] = 1.0
    offset: Annotated[float, Doc(description="Without a map: added after scaling.")] = 0.0
    weight: Annotated[float, Doc(description="The component is weight * number.")] = 1.0
    default: Annotated[
        float | None, Doc(description="Number used when the signal is absent; unset: no component then.")
    ] = None
    source: Annotated[str, Doc(description="Only signals from this source ('user', 'implicit', ...); '' = any.")] = ""

    def __post_init__(self) -> None:
        if not self.name or not self.signal:
            raise ValueError("a reward component needs a non-empty name and signal")
        numbers = [self.scale, self.offset, self.weight, *self.map.values()]
        if self.default is not None:
            numbers.append(self.default)
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError(f"component {self.name!r}: scale, offset, weight, map and default must be finite")

    def number(self, value: float | bool | str) -> float | None:
        """The signal's value as this component's number (None: not usable, treated as absent)."""
        if self.map:
            return self.map.get(label(value))
        if isinstance(value, str):
            return None
        return self.scale * float(value) + self.offset


def label(value: float | bool | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float | int):
        return format(float(value), "g")
    return value


def _default_components() -> list[RewardComponent]:
    return [
        RewardComponent(name="accepted", signal="accepted", map={"true": 1.0, "false": 0.0}),
        RewardComponent(name="dissatisfied", signal="dissatisfied", scale=-0.5),
    ]


class ServeOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The reward spec: a version and its components."""

    version: Annotated[str, Doc(description="The spec's version; part of scorer_version.")] = "v1"
    components: Annotated[list[RewardComponent], Doc(description="Named components; reward = their sum.")] = (
        msgspec.field(default_factory=_default_components)
    )

    def __post_init__(self) -> None:
        if not self.version:
            raise ValueError("the reward spec needs a version")
        names = [c.name for c in self.components]
        if not names:
            raise ValueError("the reward spec has no components")
        if len(set(names)) != len(names):
            raise ValueError(f"reward component names repeat: {sorted(names)}")


def latest(signals: list[FeedbackSignal], key: str, source: str = "") -> FeedbackSignal | None:
    """The last signal with `key` (from `source` when set): a later signal overrides an earlier one."""
    found = None
    for s in signals:
        if s.key == key and (not source or s.source == source):
            found = s
    return found


def apply_spec(spec: ServeOptions, signals: list[FeedbackSignal]) -> tuple[dict[str, float], list[str]]:
    """(components, the spec's signal keys present): the reward spec over one episode's signals."""
    components: dict[str, float] = {}
    used: list[str] = []
    for c in spec.components:
        found = latest(signals, c.signal, c.source)
        number = None if found is None else c.number(found.value)
        if number is not None:
            used.append(c.signal)
        elif c.default is not None:
            number = c.default
        if number is not None:
            components[c.name] = c.weight * number
    return components, used


@register("serve")
class Serve(Environment[ServeOptions]):
    """Served traffic scored by its feedback (see the module docstring)."""

    Options = ServeOptions
    version: ClassVar[str] = "1"
    components: ClassVar[tuple[str, ...]] = ()  # named by the spec, per instance
    has_tasks: ClassVar[bool] = False

    @property
    def scorer_version(self) -> str:
        """`serve@<env version>/<spec version>`, plus a digest of the spec when it is not the default."""
        base = f"{self.name}@{self.version}/{self.options.version}"
        if self.options == self.Options():
            return base
        digest = hashlib.blake2b(msgspec.json.encode(self.options), digest_size=4).hexdigest()
        return f"{base}+{digest}"

    def sample(self, rng: random.Random) -> Problem:
        raise NotImplementedError("'serve' has no tasks: its episodes are recorded from served traffic")

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return self.failure("a completion text alone carries no feedback signals")

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        components, used = apply_spec(self.options, episode.feedback)
        if not components:
            keys = sorted({s.key for s in episode.feedback})
            return self.failure(f"masked: no signal the spec {self.options.version!r} uses (has {keys or 'none'})")
        reason = f"signals used: {', '.join(sorted(set(used)))}" if used else "defaults only"
        return Score.of(components, correct=sum(components.values()) > 0, parse_ok=True, reason=reason)

    def failure(self, reason: str) -> Score:
        """Never a 0 for served traffic: what cannot be scored is masked (`unscorable`)."""
        return Score(reward=0.0, components={}, correct=False, parse_ok=True, reason=reason, unscorable=reason)
