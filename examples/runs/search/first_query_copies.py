"""How often a model's first search query copies the first hop's decade and kind noun from the
question, held-out beside train (greedy, the first N tasks the demo evaluates on each split).

    python examples/runs/search/first_query_copies.py examples/runs/search/search-s0/model 100
"""

import asyncio
import json
import re
import sys
from pathlib import Path

from slipstream.harness.evaluate import greedy_params
from slipstream.harness.rollout import rollout_episodes
from slipstream.run.heldout import HeldOut
from slipstream.run.presets import demo_plan

PAT = re.compile(r"the ([a-z ]+?) that dates from the (\d+s)")


async def main(model_dir: str, n: int) -> None:
    plan = demo_plan("search")  # the demo's held-out and train tasks, engine and harness
    plan.heldout_tasks, plan.train_eval_tasks = n, n
    ev = HeldOut(plan, Path(model_dir))
    await ev.start()
    out = {}
    try:
        for split, tasks in (("heldout", ev.tasks), ("train", ev.train_tasks)):
            c = {"tasks": 0, "searched": 0, "decade": 0, "kind": 0}
            for i, spec in enumerate(tasks[:n]):
                e = (
                    await rollout_episodes(
                        ev.engine,
                        ev.tokenizer,
                        ev.env,
                        spec,
                        group_size=1,
                        params=greedy_params(ev.env),
                        worker_id="dbg",
                        group_id=f"dbg/{split}/{i}",
                        summary=ev.summary,
                        frozen_engine=ev.frozen,
                        purpose="eval",
                    )
                )[0]
                m = PAT.search(spec.prompt)
                c["tasks"] += 1
                first = next((t for t in e.tool_log if t.name == "search_corpus" and t.status == "ok"), None)
                if m is None or first is None:
                    continue
                c["searched"] += 1
                kind, decade = m.group(1).split()[-1], m.group(2)
                c["decade"] += decade in first.arguments
                c["kind"] += kind in first.arguments
            out[split] = c
    finally:
        await ev.stop()
    print(json.dumps(out))


asyncio.run(main(sys.argv[1], int(sys.argv[2])))
