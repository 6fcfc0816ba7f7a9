"""`code`: a coding agent in a sandbox, rewarded by tests run in a *fresh* sandbox (Composer 2).

Each episode gets its own bubblewrap sandbox over the task's tree (libs/sandbox) and six tools
(tools.py) in the plain-text tag protocol of libs/toolcalls. A turn without a tool call ends the
episode; so does `max_turns`. The episode's answer (`final_text`) is its patch: the files the
agent changed, as JSON `{path: content | null}` taken from the sandbox's own writable layer.

Grading never trusts the agent's sandbox: the reward-model rebuilds the task's tree from its key,
applies the patch **except to protected files** (the tests and the runner, restored from the
task; a patch that touched them is counted as `tampered_tests`), and runs the tests in a new
sandbox. Components (summing to the reward):

- `tests_passed`: `pass_weight` × fraction of tests passing; `all_passed`: `all_pass_weight` when all do;
- `invalid_call`: −`invalid_call_penalty` per malformed call (Composer's broken calls as negatives);
- `unfinished_edit`: −`unfinished_edit_penalty` when the last edit came after the last test run
  (the agent stopped without checking its change);
- `length`: Composer's concave length penalty over sampled tokens, tool calls and turns
  (libs/rl `LengthPenalty`; off unless `length_penalty.scale` > 0).

Sources (`source`): `bugfix` (a flipped operator in a small module: learnable by a tiny model
after a warm-up), `programs` (thousands of grammar-drawn functions with six bug kinds, held out by
program template: programs.py) and `humaneval` (the 164 problems, as an eval suite: every problem is held out,
`generate("heldout", n)` gives problems 0..n-1 in order, and `generate("train", ...)` refuses).
The env `humaneval` is `code` with that source by default, so a suite (eval-gate `[gate] envs`,
a run file's `[eval] suites`) can hold it beside a training `code` env with other options.
Sandboxes (`sandbox`): `local` (default) keeps the episode's sandbox in the process that plays it;
`service` puts it on a tool-service replica serving the `code` tool set (service.py), reached
through the context's tools transport (`[tools] transport = "nats"`): the six tools still run
here, each sandbox operation is a request to the replica holding the sandbox. Where the context
has no remote transport (an in-process evaluation) the sandbox stays local. A sandbox that cannot
be made, or a replica that dies mid-episode, ends the episode as an `infra_error` (masked by the
reward-model and the learner, never the model's fault). Grading always builds its own fresh
sandbox in the scorer's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import tempfile
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, Split, TaskSpec, fixed_draw
from slipstream.envs.code import grader, programs, service
from slipstream.envs.code.repo import repo_keys
from slipstream.envs.code.tasks import (
    HUMANEVAL_PROBLEMS,
    OPERATORS,
    RUNNER,
    RUNNER_PATH,
    CodeTask,
    bugfix_task,
    humaneval_task,
    programs_task,
    repo_task,
    task_of_key,
)
from slipstream.envs.code.tools import sandbox_tools
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.length_penalty import LengthPenalty
from slipstream.envs.registry import register
from slipstream.sandbox import BwrapProvider, BwrapSandbox, Limits, SandboxError
from slipstream.sandbox.remote import RemoteSandbox
from slipstream.schemas import Episode, ToolEvent
from slipstream.toolcalls import LocalTransport, ToolCall, ToolRegistry, execute, renderer_for, tool_event

Doc = msgspec.Meta
T = TypeVar("T")
EDITS = ("create_file", "replace")


class CodeOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `code`; `get_env("code", source="humaneval")`."""

    source: Annotated[Literal["bugfix", "programs", "humaneval", "repo"], Doc(description="Task family.")] = "bugfix"
    max_turns: Annotated[int, Doc(description="Model turns per episode.")] = 6
    max_turn_tokens: Annotated[int, Doc(description="Most tokens one model turn may sample.")] = 160
    wall_s: Annotated[float, Doc(description="Wall-clock limit of one command in the sandbox.")] = 10.0
    memory_mb: Annotated[int, Doc(description="Memory limit of one command's process tree, MiB.")] = 256
    processes: Annotated[int, Doc(description="Processes one command may have alive at once.")] = 32
    pass_weight: Annotated[float, Doc(description="Reward for the fraction of tests passing.")] = 0.5
    all_pass_weight: Annotated[float, Doc(description="Reward when every test passes.")] = 0.5
    invalid_call_penalty: Annotated[float, Doc(description="Subtracted per malformed tool call.")] = 0.2
    unfinished_edit_penalty: Annotated[
        float, Doc(description="Subtracted when the last edit came after the last test run.")
    ] = 0.1
    length_penalty: Annotated[LengthPenalty, Doc(description="Composer's concave length penalty.")] = LengthPenalty()
    expert_guess_rate: Annotated[
        float,
        Doc(
            description="Fraction of bugfix tasks on which the scripted expert guesses the fix without reading the "
            "docstring or the failing assertion: it puts the other wrong operator in, runs the tests and stops "
            "(an imperfect teacher)."
        ),
    ] = 0.0
    sandbox_dir: Annotated[str, Doc(description="Where sandboxes live; empty: the system temp directory.")] = ""
    sandbox: Annotated[
        Literal["local", "service"],
        Doc(
            description="Where an episode's sandbox lives: 'local' (the process that plays it) or 'service' "
            "(a tool-service replica serving the 'code' set, when the tools' transport is NATS)."
        ),
    ] = "local"

    def __post_init__(self) -> None:
        if not 1 <= self.max_turns <= 64:
            raise ValueError(f"max_turns must be in 1..64, got {self.max_turns}")
        if not 16 <= self.max_turn_tokens <= 4096:
            raise ValueError(f"max_turn_tokens must be in 16..4096, got {self.max_turn_tokens}")
        for name in ("pass_weight", "all_pass_weight", "invalid_call_penalty", "unfinished_edit_penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.expert_guess_rate <= 1.0:
            raise ValueError(f"expert_guess_rate must be in [0, 1], got {self.expert_guess_rate}")

    @property
    def limits(self) -> Limits:
        return Limits(
            wall_s=self.wall_s, cpu_s=max(1, int(self.wall_s)), memory_mb=self.memory_mb, processes=self.processes
        )


@register("code")
class Code(Environment[CodeOptions]):
    """Fix or write code with file, search, shell and test tools; rewarded by tests in a fresh sandbox."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = CodeOptions
    components: ClassVar[tuple[str, ...]] = ("tests_passed", "all_passed", "invalid_call", "unfinished_edit", "length")
    warmstart_from_expert: ClassVar[bool] = True
    max_turns: ClassVar[int] = 64

    def __init__(self, options: CodeOptions | None = None) -> None:
        super().__init__(options)
        self.renderer = renderer_for("tags")

    @property
    def max_completion_chars(self) -> int:
        return self.options.max_turn_tokens

    # -- tasks ----------------------------------------------------------------------------------

    def sample(self, rng: Any) -> Problem:
        if self.options.source == "humaneval":
            task = humaneval_task(f"humaneval:{rng.randrange(HUMANEVAL_PROBLEMS)}")
        elif self.options.source == "repo":
            keys = repo_keys()
            task = repo_task(keys[rng.randrange(len(keys))])
        elif self.options.source == "programs":
            task = programs_task(programs.sample_key(rng))
        else:
            task = bugfix_task(f"bugfix:{rng.randrange(10**6)}")
        return Problem(key=task.key, prompt=task.prompt, reference=task.reference)

    def split_of(self, key: str) -> Split:
        """HumanEval is an eval suite: every one of its problems is held out, never trained on. A
        `programs` task's split is its template's (programs.HELDOUT_TEMPLATES), never its key's hash."""
        if key.startswith("programs:"):
            return "heldout" if programs.split_of(key) == "heldout" else "train"
        return "heldout" if key.startswith("humaneval:") else super().split_of(key)

    def generate(self, split: Split, n: int, seed: int) -> list[TaskSpec]:
        """As every env's, except HumanEval's: problems 0..n-1 in order (a fixed, prefix-stable subset)."""
        if self.options.source != "humaneval":
            return super().generate(split, n, seed)
        if split == "train":
            raise ValueError(f"{self.name}: HumanEval is an eval suite; all its problems are held out, none is train")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= HUMANEVAL_PROBLEMS:
            raise ValueError(f"{self.name}: HumanEval has {HUMANEVAL_PROBLEMS} problems; n must be 0..164, got {n!r}")
        tasks = []
        for number in range(n):
            code = humaneval_task(f"humaneval:{number}")
            problem = Problem(key=code.key, prompt=code.prompt, reference=code.reference)
            tasks.append(
                TaskSpec(
                    task_id=f"{self.name}-heldout-{number}",
                    env=self.name,
                    prompt=problem.prompt,
                    reference=problem.reference,
                    seed=seed,
                    split="heldout",
                    metadata={"key": problem.key},
                )
            )
        return tasks

    def code_task(self, task: TaskSpec) -> CodeTask:
        """The task's tree and tests, rebuilt from the key its reference carries (any scorer has it)."""
        try:
            key = json.loads(task.reference)["key"]
        except (ValueError, KeyError, TypeError):
            raise KeyError(f"task {task.task_id!r}: its reference names no coding task key") from None
        return task_of_key(key)

    def _root(self) -> Path:
        base = Path(self.options.sandbox_dir) if self.options.sandbox_dir else Path(tempfile.gettempdir())
        return base / "slipstream-code" / uuid.uuid4().hex[:12]

    # -- the episode ----------------------------------------------------------------------------

    async def run(self, ctx: EpisodeContext) -> Outcome:
        code = self.code_task(ctx.task)
        thread = ctx.open(ctx.task.prompt)
        root = self._root()
        provider: BwrapProvider | None = None
        sandbox: BwrapSandbox | RemoteSandbox | None = None
        finish = "max_turns"
        try:
            try:
                sandbox, provider = await self._sandbox(ctx, code, thread.sample_id, root)
            except (SandboxError, ValueError, PermissionError) as exc:
                # No sandbox, no episode: an infrastructure failure, masked (never the model's fault;
                # a host refusing the tree, e.g. too large for it, is the setup's).
                ctx.log_tool(
                    ToolEvent(sample_id=thread.sample_id, name=service.CREATE, status="infra_error", error=str(exc))
                )
                return Outcome(final_text="{}", finish_reason="infra_error")
            # A remote sandbox's call may wait out a dead replica and retry: the transport's budget
            # (attempts of the call's timeout plus a margin) must end before the tool's own.
            budget = 4 * (self.options.wall_s + 20.0) if isinstance(sandbox, RemoteSandbox) else 0.0
            registry = ToolRegistry(sandbox_tools(sandbox, code, self.options.limits, timeout_s=budget))
            transport = LocalTransport(registry)
            stops = [*self.renderer.stop_strings, self.terminator]
            for _ in range(self.options.max_turns):
                gen = await ctx.generate(thread, max_tokens=self.options.max_turn_tokens, stop=stops)
                turn = self.renderer.parse(gen.text, registry, call_id_prefix=f"{thread.sample_id}-t{gen.turn}")
                if not turn.items:
                    finish = gen.finish_reason
                    break
                results = await execute(turn.items, transport)
                for item, result in zip(turn.items, results, strict=True):
                    event = tool_event(item, result, sample_id=thread.sample_id, turn=gen.turn)
                    if result.outcome == "infra_error" and isinstance(sandbox, RemoteSandbox) and sandbox.last_error:
                        # The crash report names only the exception's type: add what the service said.
                        event = msgspec.structs.replace(event, error=f"{event.error}: {sandbox.last_error}")
                    ctx.log_tool(event)
                if any(r.outcome == "infra_error" for r in results):
                    # The sandbox (or the replica holding it) is gone: nothing more can be done in it.
                    return Outcome(final_text="{}", finish_reason="infra_error")
                ctx.observe(thread, self.renderer.render(self.renderer.result_messages(results)))
            try:
                changes = await sandbox.fetch_changes() if isinstance(sandbox, RemoteSandbox) else sandbox.changes()
            except SandboxError as exc:
                ctx.log_tool(
                    ToolEvent(sample_id=thread.sample_id, name="sandbox_changes", status="infra_error", error=str(exc))
                )
                return Outcome(final_text="{}", finish_reason="infra_error")
            patch = {
                path: (data.decode(errors="replace") if data is not None else None) for path, data in changes.items()
            }
        finally:
            if isinstance(sandbox, RemoteSandbox):
                with contextlib.suppress(SandboxError):  # a gone replica's sandboxes went with it
                    await sandbox.close()
            if provider is not None:
                await provider.aclose()
            shutil.rmtree(root, ignore_errors=True)
        return Outcome(final_text=json.dumps(patch, sort_keys=True), finish_reason=finish)

    async def _sandbox(
        self, ctx: EpisodeContext, code: CodeTask, sample_id: str, root: Path
    ) -> tuple[BwrapSandbox | RemoteSandbox, BwrapProvider | None]:
        """The episode's sandbox: on a tool-service replica (`sandbox = "service"` and a remote tools
        transport), else in this process."""
        if self.options.sandbox == "service":
            timeout_s = self.options.wall_s + 15.0
            registry = service.caller_registry(timeout_s)
            transport = ctx.tools(registry)
            if not isinstance(transport, LocalTransport):
                session = re.sub(r"[^A-Za-z0-9_.:/#-]", "_", sample_id)[:160] + "/" + uuid.uuid4().hex[:10]
                caller = service.ServiceCaller(transport, registry, session=session, timeout_s=timeout_s)
                files = {**code.files, RUNNER_PATH: RUNNER}
                remote = await RemoteSandbox.create(caller, files, session=session, limits=self.options.limits)
                return remote, None
            # No tool-service behind this context (an in-process evaluation): sandboxes stay here.
        base = code.write(root / "task")
        provider = BwrapProvider(root / "sandboxes", limits=self.options.limits)
        return await provider.create(base), provider

    # -- the scripted expert --------------------------------------------------------------------

    def expert(self, task: TaskSpec, context: str) -> str:
        """Edit with the reference fix, run the tests, then stop (one line, no call).

        With `expert_guess_rate`, on that fixed fraction of bugfix tasks (a function of the key) the
        edit is a guess made without reading the docstring or the failing assertion: the flipped
        operator becomes the *other* wrong one. The tests then fail and the expert stops all the same, as a weaker
        model's trajectory would; a warm-started model copies the guessing, RL has to unlearn it.
        """
        ref = json.loads(task.reference)
        if "<result>" not in context:
            if "content" in ref:
                call = ToolCall(id="e", name="create_file", arguments={"path": ref["path"], "content": ref["content"]})
            else:
                args = {k: ref[k] for k in ("path", "old", "new")}
                if _draw(ref["key"], "guess") < self.options.expert_guess_rate:
                    if ref["key"].startswith("bugfix:"):
                        args["new"] = _other_operator(args["old"], args["new"])
                    elif "guess" in ref:  # programs: the task's own plausible wrong fix
                        args["new"] = ref["guess"]
                call = ToolCall(id="e", name="replace", arguments=args)
            return self.renderer.render_calls("", [call])
        if "passed" not in context.rsplit("<result>", 1)[-1]:
            return self.renderer.render_calls("", [ToolCall(id="e", name="run_tests", arguments={})])
        return "done" + self.terminator

    # -- grading --------------------------------------------------------------------------------

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        score = self.grade(task, episode.final_text)
        components = dict(score.components)
        invalid = episode.counts.get("invalid_tool_call", 0)
        components["invalid_call"] = -self.options.invalid_call_penalty * invalid if invalid else 0.0
        calls = [e.name for e in episode.tool_log]
        last_edit = max((i for i, n in enumerate(calls) if n in EDITS), default=-1)
        last_test = max((i for i, n in enumerate(calls) if n == "run_tests"), default=-1)
        unfinished = last_edit > last_test
        components["unfinished_edit"] = -self.options.unfinished_edit_penalty if unfinished else 0.0
        tokens = sum(sum(s.mask()) for s in episode.samples if s.trainable)
        components["length"] = self.options.length_penalty.penalty(
            tokens=tokens, tool_calls=len(calls), turns=episode.counts.get("turns", 0)
        )
        reason = (
            score.reason
            + (f"; {invalid} invalid call(s)" if invalid else "")
            + ("; unchecked edit" if unfinished else "")
        )
        return Score.of(components, correct=score.correct, parse_ok=score.parse_ok, reason=reason)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        """Apply the patch (JSON {path: content | null}) to a fresh tree and run the task's own tests."""
        try:
            patch = json.loads(completion) if completion.strip() else {}
            if not isinstance(patch, dict) or not all(isinstance(v, str | None) for v in patch.values()):
                raise ValueError("not a {path: content | null} object")
        except ValueError as exc:
            return self.failure(f"the answer is not a patch: {exc}")
        code = self.code_task(task)
        return _in_a_loop(self._grade(code, patch))

    async def _grade(self, code: CodeTask, patch: dict[str, str | None]) -> Score:
        """The patch applied in a fresh sandbox over the task's tree, then graded by grader.py: the
        tests run where the patch cannot reach their result (see grader.py and runner.py)."""
        spec = grader.spec_of(code)
        protected = code.protected_paths
        only = grader.graded_paths(code, spec)
        tampered = sorted(p for p in patch if p.lstrip("./") in protected)
        ignored = sorted(p for p in patch if only is not None and p.lstrip("./") not in only | protected)
        root = self._root()
        base = code.write(root / "task")
        provider = BwrapProvider(root / "sandboxes", limits=self.options.limits)
        try:
            sandbox = await provider.create(base)
            for path, content in patch.items():
                if path.lstrip("./") in protected or (only is not None and path.lstrip("./") not in only):
                    continue
                if content is None:
                    await sandbox.exec(["rm", "-rf", "--", path])
                else:
                    await sandbox.write(path, content)
            tree = await sandbox.snapshot()
            try:
                verdict = await grader.grade(provider, code, tree, self.options.limits)
            finally:
                provider.release(tree)
        finally:
            await provider.aclose()
            shutil.rmtree(root, ignore_errors=True)
        fraction = verdict.passed / verdict.total if verdict.total else 0.0
        all_pass = verdict.all_passed
        reason = (
            verdict.reason
            + (f"; ignored edits to protected {tampered}" if tampered else "")
            + (f"; ignored edits outside the graded module {ignored[:3]}" if ignored else "")
        )
        return Score.of(
            {
                "tests_passed": self.options.pass_weight * fraction,
                "all_passed": self.options.all_pass_weight if all_pass else 0.0,
                "invalid_call": 0.0,
                "unfinished_edit": 0.0,
                "length": 0.0,
            },
            correct=all_pass,
            parse_ok=True,
            reason=reason,
        )


class HumanEvalOptions(CodeOptions, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `humaneval`: those of `code`, with HumanEval as the (only) source."""

    source: Annotated[Literal["humaneval"], Doc(description="Task family: HumanEval only.")] = "humaneval"
    max_turn_tokens: Annotated[
        int, Doc(description="Most tokens one model turn may sample (the longest solution, whole, fits).")
    ] = 3072


@register("humaneval")
class HumanEval(Code):
    """HumanEval's 164 problems played and graded by the `code` harness: an eval suite (pass@1 = accuracy)."""

    Options: ClassVar[type[msgspec.Struct]] = HumanEvalOptions
    warmstart_from_expert: ClassVar[bool] = False
    eval_only: ClassVar[bool] = True


def _draw(key: str, what: str) -> float:
    """A fixed number in [0, 1) per (what, key): the expert's choices are a function of the task."""
    return fixed_draw(f"{what}:{key}")


def _other_operator(old: str, new: str) -> str:
    """`new` ("a * b") with the operator that is neither `old`'s nor `new`'s ("a + b" for "a - b")."""
    (other,) = set(OPERATORS) - {old.split()[1], new.split()[1]}
    return new.replace(new.split()[1], other)


def _in_a_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
