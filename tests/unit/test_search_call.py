"""`search_call` (the real-model task) and chat-rendered prompts: scoring, and prompts through the template."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slipstream.engine import ByteTokenizer, SamplingParams, TorchEngine, build_tiny
from slipstream.engine.chat import ChatTemplate
from slipstream.envs import get_env
from slipstream.envs.searchcall import DEMO_CALL, SYSTEM
from slipstream.harness import rollout_group

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parents[1] / "fixtures" / "chat" / "smollm2-135m.jinja"


def test_scoring_separates_format_from_naming_the_subject() -> None:
    env = get_env("search_call")
    task = next(t for t in env.generate("train", 40, 0) if t.prompt.startswith("When was"))
    subject = task.reference
    exact = env.score(task, f"<search>birth date of {subject}</search>")
    assert (exact.reward, exact.correct, exact.components) == (1.0, True, {"format": 0.5, "query": 0.5})
    chatty = env.score(task, f"Sure! <search>{subject}</search>")
    assert (chatty.reward, chatty.correct, chatty.components["query"]) == (0.5, False, 0.5)
    off_topic = env.score(task, "<search>famous scientists</search>")
    assert (off_topic.reward, off_topic.correct, off_topic.components["format"]) == (0.5, False, 0.5)
    assert not env.score(task, "<search></search>").components["format"]
    none = env.score(task, f"{subject} was born long ago.")
    assert (none.reward, none.parse_ok) == (0.0, False)


def test_splits_hold_out_whole_questions_and_both_splits_are_varied() -> None:
    env = get_env("search_call")
    train = {t.prompt for t in env.generate("train", 400, 1)}
    heldout = {t.prompt for t in env.generate("heldout", 100, 1)}
    assert not train & heldout
    assert len(heldout) >= 20 and len(train) >= 150


def test_a_chat_model_sees_the_env_turns_through_its_template() -> None:
    class ChatBytes(ByteTokenizer):
        chat_template = ChatTemplate(FIXTURE.read_text())

    env = get_env("search_call")
    task = env.generate("heldout", 1, 3)[0]
    model, _ = build_tiny("tiny", seed=0)
    tok = ChatBytes()

    async def play() -> list[int]:
        engine = TorchEngine(model, tok, max_batch=2, max_seq_len=1024)
        await engine.start()
        try:
            params = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
            (traj,) = await rollout_group(engine, tok, env, task, group_size=1, params=params)
        finally:
            await engine.stop()
        return traj.ids()[: traj.prompt_len]

    prompt = asyncio.run(play())
    text = tok.decode(prompt)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    assert f"<|im_start|>assistant\n{DEMO_CALL}<|im_end|>\n" in text
    assert text.endswith(f"<|im_start|>user\n{task.prompt}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.bos_id not in prompt  # the template writes its own markers
