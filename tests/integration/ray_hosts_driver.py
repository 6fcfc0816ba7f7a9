"""The learner's rank group as a Ray driver on a namespace host, for test_ray_hosts.py (run there with `ip netns exec`).

A Ray driver attaches to the raylet of its own node, so it must run inside the head's namespace,
which the test process cannot enter: it runs this script there and talks to it in JSON lines (one
event per line on stdout; commands, one word a line, on stdin):

1. `placed` (each rank's node address and pid), `stepped` per step, `trained` (each rank's digest
   of the whole policy before and after the steps; the gathered weights saved to `<out>/ranks.pt`),
   `saved` (a DCP checkpoint of the ranks in `<out>/ckpt`);
2. on `go`: steps in a loop, `stepped` each, until a step fails (the test kills the worker node):
   `failed` with the `RankError`, its time and how long the step ran; then `closed`;
3. on `restart`: a new group on the restarted cluster, `placed`, loads the checkpoint, `resumed` (the
   digests), one step, `recovered`.

Any other failure ends the script with an `error` event and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from scored_trajectories import group

from slipstream.engine.source import ModelSource
from slipstream.learner.config import LearnerSection
from slipstream.learner.ranks import RankError, RankGroup
from slipstream.rl import LossConfig
from slipstream.schemas import ScoredEpisode, scored_episode_from_v1

SOURCE = ModelSource(preset="tiny", seed=3)
LOSS = LossConfig()
FAIL_WITHIN_S = 300.0


def section(address: str, resource: str, shared_dir: str) -> LearnerSection:
    """Two ranks on the Ray cluster at `address`, rank r where `resource` formatted with r is offered."""
    return LearnerSection(
        ranks=2,
        ray_address=address,
        rank_resource=resource,
        lr=3e-3,
        micro_batch=2,
        seed=0,
        rank_start_timeout_s=240.0,
        rank_timeout_s=30.0,
        shared_dir=shared_dir,
    )


def steps_data(steps: int) -> list[list[list[ScoredEpisode]]]:
    """`steps` steps of two arith-like groups of 4 (rewards 0, 1, 0, 1): the learner's integration data."""
    return [[[scored_episode_from_v1(t) for t in group(f"s{s}g{g}")] for g in range(2)] for s in range(steps)]


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def placed(g: RankGroup) -> None:
    emit("placed", nodes=g.rank_nodes, pids=g.rank_pids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--resource", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = section(args.address, args.resource, str(args.out))
    data = steps_data(args.steps + 1)
    ckpt = args.out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    g = RankGroup(SOURCE, cfg, LOSS)
    try:
        placed(g)
        before = g.state_digests()
        for s in range(args.steps):
            st = g.step(data[s], s, step=s)
            emit("stepped", step=s, loss=st.loss, applied=st.applied, rows=[len(r) for r in g.last_split.rows])
        after = g.state_digests()
        torch.save(g.full_state(), args.out / "ranks.pt")
        emit("trained", before=before, after=after)
        g.save(ckpt)
        emit("saved", digests=after)
        if sys.stdin.readline().strip() != "go":
            return 1
        t0 = time.monotonic()
        n = args.steps
        while time.monotonic() - t0 < FAIL_WITHIN_S:
            started = time.time()
            try:
                g.step(data[-1], n, step=n)
            except RankError as exc:
                emit("failed", error=str(exc), step_started=started, failed_at=time.time(), failed=g.failed)
                break
            emit("stepped", step=n)
            n += 1
        else:
            emit("error", error=f"no step failed within {FAIL_WITHIN_S} s")
            return 1
    finally:
        g.close()
    emit("closed")
    if sys.stdin.readline().strip() != "restart":
        return 1
    with RankGroup(SOURCE, cfg, LOSS) as again:
        placed(again)
        again.load(ckpt)
        emit("resumed", digests=again.state_digests())
        st = again.step(data[-1], args.steps, step=args.steps)
        emit("recovered", loss=st.loss, applied=st.applied, digests=again.state_digests())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        sys.exit(1)
