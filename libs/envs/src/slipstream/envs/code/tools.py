"""The coding agent's tools, each bound to one episode's sandbox.

read_file, search (a regex over the tree), create_file, replace (an exact snippet that must occur
exactly once), run (a shell command under the sandbox's limits) and run_tests. A call the model
got wrong (a path that does not exist, a snippet found zero or several times, a bad regex) raises
`ToolInputError`: it is classified `invalid_tool_call` and the message is what the model sees.
A sandbox that fails is an exception of another kind: `infra_error`, never the model's fault.
"""

from __future__ import annotations

import re
from typing import Any

from slipstream.envs.code.tasks import RUNNER_PATH, CodeTask
from slipstream.sandbox import Limits, Sandbox
from slipstream.toolcalls import Tool, ToolInputError

OUTPUT_CHARS = 600  # what one tool result shows the model, at most


def _cut(text: str) -> str:
    return text if len(text) <= OUTPUT_CHARS else text[: OUTPUT_CHARS - 20] + "\n[... output cut]"


def _path_arg(description: str) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": 200, "description": description}


def sandbox_tools(sandbox: Sandbox, task: CodeTask, limits: Limits, *, timeout_s: float = 0.0) -> list[Tool]:
    """The six tools for one episode in `sandbox`; each times out after `timeout_s` (0: the command's
    wall-clock limit plus 5 s; a remote sandbox needs room for its transport's retries)."""

    async def read_file(path: str) -> str:
        try:
            return _cut((await sandbox.read(path)).decode(errors="replace"))
        except FileNotFoundError:
            raise ToolInputError(f"no file {path!r}") from None

    async def search(pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ToolInputError(f"bad regex {pattern!r}: {exc}") from None
        found = await sandbox.exec(["grep", "-rnE", "--exclude", RUNNER_PATH, "--", pattern, "."], limits=limits)
        return _cut(found.stdout) or "no match"

    async def create_file(path: str, content: str) -> str:
        try:
            await sandbox.write(path, content)
        except PermissionError as exc:
            raise ToolInputError(str(exc)) from None
        return f"wrote {path}"

    async def replace(path: str, old: str, new: str) -> str:
        try:
            text = (await sandbox.read(path)).decode()
        except FileNotFoundError:
            raise ToolInputError(f"no file {path!r}") from None
        found = text.count(old)
        if found != 1:
            where = "not found" if found == 0 else f"found {found} times (give more context)"
            raise ToolInputError(f"the snippet is {where} in {path}")
        await sandbox.write(path, text.replace(old, new, 1))
        return f"replaced 1 snippet in {path}"

    async def run(command: str) -> str:
        result = await sandbox.exec(command, limits=limits)
        tail = f"\n[{result.reason}: {result.detail}]" if result.reason != "ok" else ""
        return _cut(result.stdout + result.stderr) + tail

    async def run_tests() -> str:
        result = await sandbox.exec(task.test_command, limits=limits)
        lines = result.stdout.strip().splitlines()
        return lines[-1] if result.reason in ("ok", "exit") and lines else f"tests did not finish: {result.detail}"

    timeout = timeout_s or limits.wall_s + 5
    no_args: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

    def schema(**props: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    text = {"type": "string", "maxLength": 4000}
    return [
        Tool("read_file", "Show a file.", schema(path=_path_arg("file path")), read_file, timeout),
        Tool("search", "Lines matching a regex, in every file.", schema(pattern=text), search, timeout),
        Tool(
            "create_file",
            "Create or overwrite a file.",
            schema(path=_path_arg("file path"), content=text),
            create_file,
            timeout,
        ),
        Tool(
            "replace",
            "Replace one exact, unique snippet of a file.",
            schema(path=_path_arg("file path"), old={"type": "string", "minLength": 1, "maxLength": 4000}, new=text),
            replace,
            timeout,
        ),
        Tool(
            "run",
            "Run a shell command.",
            schema(command={"type": "string", "minLength": 1, "maxLength": 1000}),
            run,
            timeout,
        ),
        Tool("run_tests", "Run the task's tests.", no_args, run_tests, timeout),
    ]
