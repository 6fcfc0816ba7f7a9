"""The committed wire contract: proto/ matches the code, and old messages still decode.

Fixtures under tests/fixtures/wire/v1 were encoded by schema version 1 and are never
regenerated: if a change makes one fail to decode, the change broke compatibility.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import msgspec
import pytest

from slipstream.schemas import MESSAGE_TYPES, ScoredTrajectory, Trajectory, decode

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "wire" / "v1"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_proto_has_no_drift() -> None:
    stale = _gen_proto().drift()
    assert stale == [], f"proto/ is out of date, run `make schemas`: {stale}"


@pytest.mark.parametrize("name", sorted(MESSAGE_TYPES))
def test_v1_fixture_still_decodes(name: str) -> None:
    data = (FIXTURES / f"{name}.msgpack").read_bytes()
    msg = decode(data, MESSAGE_TYPES[name])
    assert isinstance(msg, MESSAGE_TYPES[name])


def test_v1_trajectory_fields_survive() -> None:
    s = decode((FIXTURES / "ScoredTrajectory.msgpack").read_bytes(), ScoredTrajectory)
    assert s.reward == pytest.approx(1.1)
    assert s.trajectory.ids() == [51, 43, 53, 61, 56, 258]
    assert s.trajectory.versions() == [7, 8]


@pytest.mark.parametrize("name", sorted(MESSAGE_TYPES))
def test_committed_schema_evolves_append_only(name: str) -> None:
    """Every property in the committed schema keeps its type; new properties are optional."""
    committed = json.loads((ROOT / "proto" / "schemas" / f"{name}.schema.json").read_text())
    current = msgspec.json.schema(MESSAGE_TYPES[name])
    for defname, old in committed.get("$defs", {}).items():
        new = current["$defs"].get(defname)
        assert new is not None, f"{defname} disappeared from the schema"
        for prop, old_type in old.get("properties", {}).items():
            assert prop in new["properties"], f"{defname}.{prop} was removed"
            assert new["properties"][prop] == old_type, f"{defname}.{prop} changed type"
        added_required = set(new.get("required", [])) - set(old.get("required", []))
        assert not added_required, f"{defname}: new fields must have defaults: {added_required}"


def test_older_producer_and_newer_producer_interoperate() -> None:
    """A message from a producer one field behind or ahead still decodes (msgspec evolution rules)."""

    class TrajectoryOld(msgspec.Struct, kw_only=True):
        trajectory_id: str
        task_id: str
        env: str

    class TrajectoryNew(msgspec.Struct, kw_only=True):
        trajectory_id: str
        task_id: str
        env: str
        brand_new_field: int = 7

    old = msgspec.msgpack.encode(TrajectoryOld(trajectory_id="a", task_id="b", env="c"))
    assert decode(old, Trajectory).finish_reason == ""
    new = msgspec.msgpack.encode(TrajectoryNew(trajectory_id="a", task_id="b", env="c"))
    assert decode(new, Trajectory).trajectory_id == "a"
