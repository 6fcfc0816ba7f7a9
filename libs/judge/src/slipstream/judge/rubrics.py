"""Rubric sets as versioned data, and the deterministic choice of K of their M rubrics per episode.

A rubric file (TOML or JSON) holds one or more sets, each for one task context at one version:

    [[rubric_set]]
    context = "serve"
    version = "v3"
    [[rubric_set.rubrics]]
    id = "direct"
    text = "The answer addresses the user's request directly, without preamble."
    weight = 2.0

Several alternative rubrics per context keep any single one from being gamed (Kimi K2.5's GRMs);
sampling K of them per episode, seeded by the episode id, makes a redelivered episode meet the
same rubrics (and the same cache entries) in any replica.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec

Doc = msgspec.Meta

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Rubric(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    id: Annotated[str, Doc(description="Stable id: letters, digits, '_.-'; a new wording deserves a new id.")]
    text: Annotated[str, Doc(description="The criterion the judge scores the response against.")]
    weight: Annotated[float, Doc(description="Weight in the weighted mean / majority vote.", gt=0)] = 1.0


class RubricSet(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    context: Annotated[str, Doc(description="Task context the set applies to (e.g. 'serve', 'coding').")]
    version: Annotated[str, Doc(description="Version of the set; recorded with every score it produces.")]
    rubrics: Annotated[list[Rubric], Doc(description="The M alternative rubrics.")]

    @property
    def label(self) -> str:
        """'context@version', the provenance string recorded with scores."""
        return f"{self.context}@{self.version}"

    def rubric(self, rubric_id: str) -> Rubric:
        for r in self.rubrics:
            if r.id == rubric_id:
                return r
        raise KeyError(f"rubric set {self.label} has no rubric {rubric_id!r}")


class _File(msgspec.Struct, forbid_unknown_fields=True):
    rubric_set: list[RubricSet]


class RubricError(ValueError):
    """A rubric file that cannot be used; the message names the file and what is wrong."""


def parse_rubric_sets(data: bytes | str, *, source: str = "<rubrics>", fmt: str = "toml") -> list[RubricSet]:
    """Every rubric set of a TOML (`fmt='toml'`) or JSON document, validated."""
    try:
        raw = tomllib.loads(data.decode() if isinstance(data, bytes) else data) if fmt == "toml" else json.loads(data)
        sets = msgspec.convert(raw, _File).rubric_set
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RubricError(f"{source}: not valid {fmt.upper()}: {exc}") from exc
    except msgspec.ValidationError as exc:
        raise RubricError(f"{source}: {exc}") from exc
    seen: set[tuple[str, str]] = set()
    for s in sets:
        where = f"{source}: rubric set {s.label}"
        if not s.context or not s.version:
            raise RubricError(f"{where}: context and version must not be empty")
        if (s.context, s.version) in seen:
            raise RubricError(f"{where} appears twice")
        seen.add((s.context, s.version))
        if not s.rubrics:
            raise RubricError(f"{where} has no rubrics")
        ids: set[str] = set()
        for r in s.rubrics:
            if not _ID.match(r.id):
                raise RubricError(f"{where}: rubric id {r.id!r} must be 1-64 of letters, digits and '_.-'")
            if r.id in ids:
                raise RubricError(f"{where}: rubric id {r.id!r} appears twice")
            if not r.text.strip():
                raise RubricError(f"{where}: rubric {r.id!r} has no text")
            ids.add(r.id)
    return sets


def load_rubric_sets(path: str | Path) -> list[RubricSet]:
    """Every rubric set of a `.toml` or `.json` file."""
    p = Path(path)
    fmt = "json" if p.suffix.lower() == ".json" else "toml"
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise RubricError(f"rubric file {str(p)!r} cannot be read: {exc}") from exc
    return parse_rubric_sets(data, source=str(p), fmt=fmt)


def select_set(sets: list[RubricSet], context: str, version: str = "", *, source: str = "<rubrics>") -> RubricSet:
    """The set for `context` at `version`; without a version, the context's only set."""
    of_context = [s for s in sets if s.context == context]
    if not of_context:
        known = sorted({s.context for s in sets})
        raise RubricError(f"{source}: no rubric set for context {context!r}; contexts: {known}")
    if version:
        for s in of_context:
            if s.version == version:
                return s
        raise RubricError(
            f"{source}: context {context!r} has no version {version!r}; versions: {[s.version for s in of_context]}"
        )
    if len(of_context) > 1:
        raise RubricError(
            f"{source}: context {context!r} has versions {[s.version for s in of_context]}: name one with `version`"
        )
    return of_context[0]


def sample_rubrics(rubric_set: RubricSet, k: int, episode_id: str) -> list[Rubric]:
    """K of the set's M rubrics (all of them when k is 0 or >= M), chosen by the episode id alone.

    The seed is a sha256 of the set's label and the episode id, so the choice is the same in
    every process and Python version (no `hash()` randomisation), and differs between sets.
    """
    rubrics = list(rubric_set.rubrics)
    if k <= 0 or k >= len(rubrics):
        return rubrics
    seed = int.from_bytes(hashlib.sha256(f"{rubric_set.label}\0{episode_id}".encode()).digest()[:8], "big")
    return random.Random(seed).sample(rubrics, k)
