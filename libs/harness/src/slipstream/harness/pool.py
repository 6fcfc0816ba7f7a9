"""The pinned pool's side of a frozen sub-agent: rebuild the child env and task from a request, play it.

The parent's side (the request a spawn becomes, the merge of the reply) is subagents.py; this
side plays the child with the same recorder an in-process child gets (episode.py), so the
reply's samples read exactly as if the child had run in the parent's episode.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from slipstream.engine.interface import Engine
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import Environment
from slipstream.envs.context import ContextFull, Outcome
from slipstream.envs.registry import get_env
from slipstream.harness.episode import EpisodeRun, Recorder
from slipstream.harness.state import EpisodeState
from slipstream.harness.subagents import params_of, task_of
from slipstream.schemas import SubagentReply, SubagentRequest


async def play_subagent(
    engine: Engine,
    tokenizer: Tokenizer,
    request: SubagentRequest,
    *,
    worker_id: str = "",
    tools: Any = None,
    max_seq_len: int | None = None,
    envs: dict[str, Environment[Any]] | None = None,
) -> SubagentReply:
    """The pool's side: rebuild the child env and task from `request` and play it on `engine`.

    `envs` caches the built environments by name and options (building one may be costly: a
    corpus, an index), so a pool builds each once. Raises `EnvError` (unknown env, bad options)
    or ValueError (bad split) for a request that can never be served; the caller turns those
    into an error reply.
    """
    key = f"{request.env}:{msgspec.json.encode(request.env_options, order='sorted').decode()}"
    env = envs.get(key) if envs is not None else None
    if env is None:
        env = get_env(request.env, **request.env_options)
        if envs is not None:
            envs[key] = env
    spec = task_of(request)
    run = EpisodeRun(
        engine=engine,
        tokenizer=tokenizer,
        params=params_of(request.sampling, request.seed),
        group_id=request.request_id,
        index=0,
        max_seq_len=max_seq_len,
        chat=env.chat_messages,
        tools=tools,
    )
    state = EpisodeState(episode_id=request.request_id)
    child = Recorder(run, state, spec, agent_id=request.agent_id, role=request.role, trainable=False, nested=True)
    t0 = time.perf_counter()
    try:
        outcome = await env.run(child)
    except ContextFull:
        root = state.samples[0] if state.samples else None
        outcome = Outcome(final_text=root.completion_text() if root is not None else "", finish_reason="length")
    finally:
        release = getattr(engine, "release", None)
        if release is not None:
            for sample in state.samples:
                release(sample.sample_id)
    steps = outcome.steps or child.steps()
    versions = [seg[0] for s in state.samples for seg in s.segments]
    return SubagentReply(
        request_id=request.request_id,
        samples=[s.to_sample() for s in state.samples],
        tool_log=list(state.tool_log),
        counts=dict(state.counts),
        final_text=outcome.final_text,
        finish_reason=outcome.finish_reason or state.last_finish,
        steps=steps,
        policy_version=max(versions) if versions else engine.policy_version,
        worker_id=worker_id,
        elapsed_s=time.perf_counter() - t0,
    )
