"""The verifiers side of the `verifiers` environment: plays verifiers v1 episodes on request.

Runs under verifiers' own interpreter (its venv: verifiers 0.4 pins openai < 3, the project
openai >= 3), started by `bridge.Runner` as `python runner.py`; it imports nothing of
Slipstream. One JSON object per line on stdin asks for one episode, one JSON line on stdout
answers it; episodes run concurrently. The answers have a descriptor of their own: file
descriptor 1 (and `sys.stdout`) is pointed at stderr, so what a taskset, a game engine or a
child process prints (textarena's games call `nltk.download`, which prints) cannot corrupt them.

    ask:    {"id", "env": <verifiers EnvConfig as a dict>, "task": <taskset index>,
             "base_url", "headers", "model", "renderer_model", "renderer": <RendererConfig dict>,
             "sampling": {...}}
    answer: {"id", "ok", "rewards": {name: weighted value}, "metrics", "errors", "reply", "turns"}
    cancel: {"cancel": <id>}: the asker gave up on that episode; it is cancelled (verifiers tears
            down its harness and tool servers) and not answered.

Nothing started for an episode outlives the runner (reaper.py): it is the subreaper of every
process beneath it (verifiers starts each episode's MCP tool server in a session of its own) and
gets SIGTERM when its parent dies. On end of input or SIGTERM it cancels the episodes in flight
(their answers have no reader any more), lets verifiers tear them and its environments down for
at most `TEARDOWN_S` each, then terminates and kills whatever is still running beneath it.

The episode is verifiers' own: `load_environment(EnvConfig)` builds the env (taskset, harness,
judges), `Env.run_slot` plays the task through its harness, whose training client
(`TrainClientConfig`: client-side rendering, vLLM's `/inference/v1/generate`) calls `base_url`
with `headers` on every request. Environments are built once per distinct config and kept
serving for the life of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import verifiers.v1 as vf  # type: ignore[import-not-found]  # lives in verifiers' own venv
from reaper import hold_descendants, kill_tree, terminate_tree  # type: ignore[import-not-found]  # beside this file
from renderers.configs import CustomRendererConfig  # type: ignore[import-not-found]
from verifiers.v1.utils.loaders import load_environment, resolve_env_config  # type: ignore[import-not-found]

TAG_PARSER = "slipstream-tags"
TEARDOWN_S = 3.0  # each: in-flight episodes' own teardown, then the environments' (bridge.CLOSE_S bounds all)
# renderer.py beside this file, loaded by `renderers` from its path: the next turn extends the sampled ids.
EXTENDING_RENDERER = f"{Path(__file__).with_name('renderer.py')}:ExtendingRenderer"


class TagToolParser:
    """`<tool_call>{"name", "arguments"}</tool_call>` found in the decoded text (renderers' own parsers
    need the tags to be single tokens; a byte-level tokenizer spells them out)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _cut(self, ids: list[int], chars: int) -> int:
        """The fewest leading ids whose decoded text covers the first `chars` characters."""
        for n in range(len(ids) + 1):
            if len(self.tokenizer.decode(ids[:n], skip_special_tokens=False)) >= chars:
                return n
        return len(ids)

    def extract(self, ids: list[int]) -> tuple[list[int], list[Any]]:
        from renderers.base import ParsedToolCall, ToolCallParseStatus  # type: ignore[import-not-found]

        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        first = text.find(self.OPEN)
        if first < 0:
            return ids, []
        calls: list[Any] = []
        at = first
        while at >= 0:
            end = text.find(self.CLOSE, at)
            body = text[at + len(self.OPEN) : end if end >= 0 else len(text)].strip()
            span = (self._cut(ids, at), self._cut(ids, end + len(self.CLOSE)) if end >= 0 else len(ids))
            if end < 0:
                calls.append(ParsedToolCall(raw=body, token_span=span, status=ToolCallParseStatus.UNCLOSED_BLOCK))
                break
            try:
                parsed = json.loads(body)
            except json.JSONDecodeError:
                calls.append(ParsedToolCall(raw=body, token_span=span, status=ToolCallParseStatus.INVALID_JSON))
            else:
                name = parsed.get("name", "") if isinstance(parsed, dict) else ""
                arguments = parsed.get("arguments", {}) if isinstance(parsed, dict) else {}
                status = ToolCallParseStatus.OK if name else ToolCallParseStatus.MISSING_NAME
                calls.append(
                    ParsedToolCall(raw=body, name=name or None, arguments=arguments, token_span=span, status=status)
                )
            at = text.find(self.OPEN, end + len(self.CLOSE))
        return ids[: self._cut(ids, first)], calls


def register_tag_parser() -> None:
    from renderers import parsers  # type: ignore[import-not-found]

    parsers.TOOL_PARSERS.setdefault(TAG_PARSER, TagToolParser)


class Envs:
    """Loaded environments by config, each inside its `serving()` context, and their task lists."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self.stack = stack
        self.loaded: dict[str, tuple[Any, list[Any]]] = {}
        self.lock = asyncio.Lock()

    async def get(self, config: dict[str, Any], tasks_needed: int) -> tuple[Any, list[Any]]:
        key = json.dumps(config, sort_keys=True)
        async with self.lock:
            if key not in self.loaded:
                env = load_environment(resolve_env_config(config))
                await self.stack.enter_async_context(env.serving())
                self.loaded[key] = (env, [])
            env, tasks = self.loaded[key]
            if len(tasks) < tasks_needed:
                # Tasksets may be infinite generators: read only as far as asked.
                tasks.clear()
                for i, task in enumerate(env.taskset):
                    tasks.append(task)
                    if i + 1 >= tasks_needed:
                        break
            return env, tasks


async def play(envs: Envs, ask: dict[str, Any]) -> dict[str, Any]:
    env, tasks = await envs.get(ask["env"], int(ask["task"]) + 1)
    if int(ask["task"]) >= len(tasks):
        raise IndexError(f"taskset has {len(tasks)} tasks; task {ask['task']} asked")
    task = tasks[int(ask["task"])]
    renderer = ask.get("renderer") or {}
    client = vf.TrainClientConfig(
        base_url=ask["base_url"],
        api_key_var="SLIPSTREAM_VF_KEY",
        headers=dict(ask.get("headers") or {}),
        renderer_model_name=ask["renderer_model"],
        renderer=CustomRendererConfig(
            import_path=EXTENDING_RENDERER, **{k: v for k, v in renderer.items() if k != "name"}
        )
        if renderer.get("name", "default") == "default"
        else None,
    )
    ctx = vf.ModelContext(
        model=ask["model"], client=client, sampling=vf.Sampling.model_validate(ask.get("sampling") or {})
    )
    episode = await env.run_slot(env.slots(task)[0], ctx)
    rewards: dict[str, float] = {}
    metrics: dict[str, float] = {}
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    reply, turns = "", 0
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is not None:
                rewards[name] = rewards.get(name, 0.0) + float(reward.value)
        for name, value in trace.metrics.items():
            if value is not None:
                metrics[name] = float(value)
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
        reply = trace.last_reply or reply
        turns += sum(1 for node in trace.nodes if node.sampled)
    return {
        "ok": bool(episode.ok),
        "rewards": rewards,
        "metrics": metrics,
        "errors": errors,
        "reply": reply,
        "turns": turns,
    }


def answer_channel() -> Any:
    """The process's stdout moved to a descriptor of its own; fd 1 and `sys.stdout` now go to stderr."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def forget(jobs: dict[str, asyncio.Task[None]], ident: str, _: object) -> None:
    jobs.pop(ident, None)


async def main() -> None:
    hold_descendants()
    out_channel = answer_channel()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    write_lock = asyncio.Lock()

    async def answer(ask: dict[str, Any]) -> None:
        try:
            out = await play(envs, ask)
        except Exception as exc:  # reported to the asker, which fails that one episode
            out = {
                "ok": False,
                "rewards": {},
                "metrics": {},
                "errors": [f"{type(exc).__name__}: {exc}"],
                "traceback": traceback.format_exc(),
                "reply": "",
                "turns": 0,
            }
        out["id"] = ask.get("id")
        async with write_lock:
            out_channel.write(json.dumps(out) + "\n")
            out_channel.flush()

    register_tag_parser()
    running: set[asyncio.Task[None]] = set()
    jobs: dict[str, asyncio.Task[None]] = {}  # by the asker's id, so it can cancel one
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    stack = contextlib.AsyncExitStack()
    envs = Envs(stack)
    out_channel.write(json.dumps({"ready": True}) + "\n")
    out_channel.flush()
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while True:
            read = asyncio.ensure_future(reader.readline())
            await asyncio.wait({read, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                break
            line = read.result()
            if not line:
                break
            if not line.strip():
                continue
            ask = json.loads(line)
            if "cancel" in ask:  # the asker gave up on that episode: no one reads its answer
                cancelled = jobs.pop(str(ask["cancel"]), None)
                if cancelled is not None:
                    cancelled.cancel()
                continue
            job = asyncio.create_task(answer(ask))
            ident = str(ask.get("id"))
            jobs[ident] = job
            running.add(job)
            job.add_done_callback(running.discard)
            job.add_done_callback(functools.partial(forget, jobs, ident))
    finally:
        # The asker is gone (end of input) or stopping us: no one reads answers any more.
        for job in running:
            job.cancel()
        if running:
            await asyncio.wait(running, timeout=TEARDOWN_S)
        try:
            await asyncio.wait_for(stack.aclose(), TEARDOWN_S)
        except Exception as exc:  # reported; what it left running is killed below
            print(f"verifiers runner: environments' teardown failed: {exc!r}", file=sys.stderr)
        stopping.cancel()
        await asyncio.to_thread(terminate_tree, os.getpid(), 1.0)
        killed = kill_tree(os.getpid(), include_root=False)
        if killed:
            print(f"verifiers runner: killed {len(killed)} processes left beneath it: {killed}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
