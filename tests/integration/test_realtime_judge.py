"""The realtime demo's side judge against a scripted judge server: per-rubric agreement with the users.

The judge (libs/judge, through the real `openai` client over loopback) scores answers the
simulated users judged; the scripted server stands in for the judge model, continuing the
prefilled `SCORE:` verdict: the `word-letters` rubric agrees with the users exactly, `reverses`
answers malformed once (re-asked) and then a score unrelated to the verdicts, and `one-word`
never answers in the format (unscorable).
"""

from __future__ import annotations

import pytest
from scripted_judge import Call, Reply, ScriptedJudge

from slipstream.run.realtime_judge import judge_cycles
from slipstream.run.sim import PREFERENCES, SimStats, Turn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ACCEPTS = PREFERENCES["word_letters"][1]
WORD_LETTERS = "The response uses only letters that appear in the word from the request."
REVERSES = "The response is the word from the request spelled backwards, exactly."


def _turn(i: int, version: int, word: str, answer: str) -> Turn:
    return Turn(
        session_id=f"s{i}",
        user=0,
        turn=0,
        word=word,
        answer=answer,
        accepted=ACCEPTS(word, answer),
        version=version,
        segments=[[version, 4]],
        call_id=f"call-{i}",
        sent_at=0.0,
        answered_at=0.0,
    )


def _script(words: dict[str, str]) -> object:
    def reply(call: Call) -> Reply:
        # The judge prefills its verdicts: the scripted model only continues "SCORE:".
        if call.messages[-1] != {"role": "assistant", "content": "SCORE:"} or not call.body["continue_final_message"]:
            return Reply(text="no prefill, no verdict")
        word = words[call.response]
        if call.rubric == WORD_LETTERS:
            return Reply(text=" 10" if ACCEPTS(word, call.response) else " 0")
        if call.rubric == REVERSES:
            if call.attempt == 0:
                return Reply(text=" fine")  # "SCORE: fine": re-asked
            return Reply(text=" 7")
        return Reply(text=" one word, I think")  # never a number: unscorable

    return reply


async def test_agreement_per_rubric_and_version() -> None:
    words = ["abc", "dog", "sun", "map", "kit", "red"]
    stats = SimStats()
    for i in range(24):
        word = words[i % len(words)]
        # Every third answer the exact reversal (accepted), the rest unique strings the users judge
        # by their preference (the scripted judge sees only the response: one word per response).
        answer = word[::-1] if i % 3 == 0 else "zq" + "abcdefghijklmnopqrstuvwx"[i]
        stats.turns.append(_turn(i, 0 if i < 12 else 3, word, answer))
    words_of = {t.answer: t.word for t in stats.turns}
    server = await ScriptedJudge(_script(words_of)).start()  # type: ignore[arg-type]
    try:
        per_version, overall = await judge_cycles(stats, [0, 3], server.url, "scripted", per_cycle=12, seed=0)
    finally:
        await server.close()
    assert set(per_version) == {0, 3}
    rubrics = overall["rubrics"]
    # The rubric the users' preference matches agrees with every verdict.
    assert rubrics["word-letters"]["accuracy"] == 1.0 and rubrics["word-letters"]["correlation"] == 1.0
    # A constant score says nothing about the users: no correlation (NaN, or ~0 after rounding).
    if "reverses" in rubrics:
        assert abs(rubrics["reverses"]["correlation"] or 0.0) < 0.01
    # `one-word` never answered in the format: no scores at all, so no row.
    assert "one-word" not in rubrics
    assert overall["judge"]["rubric_set"] == "realtime-sim@v1" and overall["answers_judged"] == 24
    for v in (0, 3):
        assert per_version[v]["answers_judged"] == 12
        assert per_version[v]["agreement"] is not None
    # Malformed verdicts were re-asked (attempt 1 exists for `reverses`).
    assert any(c.attempt == 1 for c in server.calls if c.rubric == REVERSES)
    # Every rubric verdict is counted: scored, or unscorable with its reason (not logged line by line).
    verdicts = overall["verdicts"]
    assert verdicts["scored"] + verdicts["unscorable"] == 24 * 2
    assert verdicts["unscorable"] > 0 and set(verdicts["unscorable_by_reason"]) == {"malformed"}
    assert overall["judge"]["prefill"] == "SCORE:"


@pytest.mark.timeout(240)
async def test_smollm2_judge_verdicts_parse_with_the_prefill() -> None:
    """`--judge smollm2`: SmolLM2-135M-Instruct served in-process (its ChatML renderer) continues the
    prefilled `SCORE:` with a number; without the prefill its prose never parsed (README)."""
    from slipstream.run.realtime_judge import local_judge

    stats = SimStats()
    for i, (word, answer) in enumerate([("abc", "cba"), ("dog", "ggg"), ("sun", "nus"), ("map", "xyz")]):
        stats.turns.append(_turn(i, 0, word, answer))
    async with local_judge("smollm2") as (url, model):
        _, overall = await judge_cycles(stats, [0], url, model, per_cycle=4, seed=0)
    verdicts = overall["verdicts"]
    assert overall["judge"]["model"] == "smollm2-135m" and verdicts["calls"] >= 8
    # Greedy (temperature 0): every verdict parsed on this machine; a few numeric flips elsewhere are tolerated.
    assert verdicts["scored"] >= 6, verdicts
