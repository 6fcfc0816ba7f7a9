"""What `slipstream chaos` reads back after its run: the JetStream store and the run's own records.

`audit` reads the streams (what was published, dead-lettered and left), the announce log against
the signed manifests, the workers' logs (versions applied and refused) and the learner's outcome
log, and joins them with the trajectory tap's ids (accounting.py) into the figures the suite
prints.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

IMPOSTOR_VERSION = 10_000_000
"""The version the permission fault's impostors announce: it must never reach the WEIGHTS log."""


async def read_streams(url: str) -> dict[str, list[tuple[str, bytes, dict[str, str]]]]:
    """Every message still stored in the streams the accounting reads: (subject, body, headers)."""
    import nats
    from nats.js.errors import NotFoundError

    servers = [u.strip() for u in url.split(",") if u.strip()]  # one server, or every node of a cluster
    nc = await nats.connect(servers=servers, name="chaos-audit")
    out: dict[str, list[tuple[str, bytes, dict[str, str]]]] = {}
    try:
        js = nc.jetstream()
        for stream in ("TRAJ_RAW", "TRAJ_SCORED", "WEIGHTS", "DLQ"):
            state = (await js.stream_info(stream)).state
            rows = out.setdefault(stream, [])
            # An empty stream of a cluster reports first_seq 0, and asking for message 0 is a bad request.
            for seq in range(max(state.first_seq, 1), state.last_seq + 1):
                try:
                    m = await js.get_msg(stream, seq)
                except NotFoundError:
                    continue
                rows.append((m.subject or "", m.data or b"", dict(m.headers or {})))
            out[f"{stream}:last_seq"] = [("", str(state.last_seq).encode(), {})]
    finally:
        await nc.close()
    return out


# -- reading the run's records -----------------------------------------------------------------------


def _log_rows(path: Path, event: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return rows
    for line in lines:
        if event not in line or not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("event") == event:
            rows.append(row)
    return rows


def _when(row: dict[str, Any]) -> float:
    ts = row.get("timestamp")
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0
    return float(ts or 0.0)


def applied_versions(path: Path) -> list[tuple[int, float]]:
    """(version, wall time) of every "applied weights" line in a rollout worker's log."""
    return [(int(r["policy_version"]), _when(r)) for r in _log_rows(path, "applied weights")]


def refused_versions(path: Path) -> set[int]:
    """Versions a rollout worker refused on fetch: skipped after a failed fetch, or a fetch whose
    shard failed its sha256 (the worker then retries, or drops the version once a newer one came)."""
    rows = _log_rows(path, "weight version skipped; still sampling with the current one")
    out = {int(r["policy_version"]) for r in rows if r.get("reason") == "fetch"}
    retries = _log_rows(path, "weight fetch failed; retrying")
    return out | {int(r["policy_version"]) for r in retries if "CorruptShard" in str(r.get("error", ""))}


def _episode_id(subject: str, body: bytes, headers: dict[str, str]) -> str | None:
    from slipstream.schemas import SCHEMA_HEADER, Episode, ScoredEpisode, decode_message

    try:
        if subject.startswith("traj.raw.") or ".TRAJ_RAW" in subject:
            return decode_message(body, headers.get(SCHEMA_HEADER), Episode).episode_id
        return decode_message(body, headers.get(SCHEMA_HEADER), ScoredEpisode).episode.episode_id
    except Exception:
        return None


def audit(
    run_dir: Path,
    run_id: str,
    trusted_keys: list[str],
    tap_ids: set[str],
    streams: dict[str, list[tuple[str, bytes, dict[str, str]]]] | None = None,
) -> dict[str, Any]:
    """Read the finished run's JetStream store (on a fresh nats-server), manifests, logs and outcome log.

    `streams`: what `read_streams` read from the live servers instead (a cluster's replicated store
    is read while it runs: `chaos --hosts`)."""
    import msgspec

    from slipstream.chaos.accounting import AnnounceRecord, join_trajectories, versions_announced_twice
    from slipstream.learner.outcomes import read_outcomes
    from slipstream.schemas import SCHEMA_HEADER, WeightAnnounce, WeightManifest, decode_message, from_json
    from slipstream.schemas.dead_letter import H_REASON, H_STREAM
    from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
    from slipstream.stack import start_nats
    from slipstream.store import LocalObjectStore, ObjectNotFound
    from slipstream.trust import Keyring
    from slipstream.trust.signing import Check, check_manifest

    if streams is None:
        server = start_nats(run_dir / "data" / "nats", run_dir / "logs" / "audit")
        try:
            streams = asyncio.run(read_streams(server.url))
        finally:
            server.stop()

    left: set[str] = set()
    left_garbage = 0
    for stream in ("TRAJ_RAW", "TRAJ_SCORED"):
        for subject, body, headers in streams[stream]:
            tid = _episode_id(subject, body, headers)
            if tid is None:
                left_garbage += 1
            else:
                left.add(tid)
    dead: set[str] = set()
    dead_by_stream: dict[str, dict[str, int]] = {}
    dead_garbage = 0
    for subject, body, headers in streams["DLQ"]:
        stream = headers.get(H_STREAM) or subject.removeprefix("dlq.")
        reason = (headers.get(H_REASON) or "?").split(":")[0][:60]
        by = dead_by_stream.setdefault(stream, {})
        by[reason] = by.get(reason, 0) + 1
        if stream in ("TRAJ_RAW", "TRAJ_SCORED"):
            tid = _episode_id("traj.raw." if stream == "TRAJ_RAW" else "traj.scored.", body, headers)
            if tid is None:
                dead_garbage += 1
            else:
                dead.add(tid)

    outcomes_path = run_dir / "learner-outcomes.jsonl"
    outcomes = [msgspec.structs.asdict(o) for o in read_outcomes(outcomes_path)] if outcomes_path.exists() else []
    join = join_trajectories(tap_ids, outcomes, dead, left)

    store = LocalObjectStore(run_dir / "data" / "store")
    keyring = Keyring.parse(trusted_keys)
    records: list[AnnounceRecord] = []
    garbage_announces = impostors = 0
    for subject, body, headers in streams["WEIGHTS"]:
        if subject != WEIGHTS_ANNOUNCE:
            continue
        try:
            a = decode_message(body, headers.get(SCHEMA_HEADER), WeightAnnounce)
        except Exception:
            garbage_announces += 1
            continue
        if a.run_id != run_id:
            continue
        if a.policy_version == IMPOSTOR_VERSION:
            impostors += 1
        why = ""
        try:
            m = from_json(store.get(a.manifest_key), WeightManifest)
            if m.run_id != run_id or m.policy_version != a.policy_version:
                why = "manifest is another version"
            elif check_manifest(m, keyring) is not Check.OK:
                why = f"signature: {check_manifest(m, keyring).value}"
            elif m.fence_token != a.fence_token:
                why = "fence token not the signed one"
        except ObjectNotFound:
            why = "no manifest"
        records.append(AnnounceRecord(a.policy_version, not why, why))
    twice = versions_announced_twice(records)

    applied: list[tuple[int, float]] = []
    refused: set[int] = set()
    for log in sorted((run_dir / "logs").glob("rollout-worker*.log")):
        applied += applied_versions(log)
        refused |= refused_versions(log)
    return {
        "join": join,
        "left_garbage": left_garbage,
        "dead_garbage": dead_garbage,
        "dead_letters": dead_by_stream,
        "raw_last_seq": int(streams["TRAJ_RAW:last_seq"][0][1]),
        "scored_last_seq": int(streams["TRAJ_SCORED:last_seq"][0][1]),
        "announces": records,
        "garbage_announces": garbage_announces,
        "impostor_announces": impostors,
        "announced_twice": twice,
        "applied": applied,
        "refused_by_workers": sorted(refused),
    }
