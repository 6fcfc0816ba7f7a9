"""One turn's tool calls under the search harness's rules (see env.py for the rules themselves).

`TurnRunner.turn` takes a turn's parsed calls and returns the observation text (one
`<result>...</result>` per call, in call order) and the sample to append it to. It runs the
turn's prunes first (validated against the view; a context edit, `ctx.branch`), refuses calls
past the hard cutoff, injects the hidden arguments (seen-chunk exclusion, the per-call budget, the
question for read reranking), runs the retrieval calls concurrently through the episode's
transport, trims results to what the budget leaves after the reserve, records which chunks were
seen, validates prunes against the view and logs every call (`ToolEvent`, with the returned chunk
ids in `info["chunks"]`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.envs.context import EpisodeContext, Thread
from slipstream.envs.search.options import SearchOptions
from slipstream.envs.search.tools import PRUNE, READ, RETRIEVAL_TOOLS, chunk_blocks
from slipstream.envs.search.view import SOFT_MESSAGE, View, refusal, usage_line
from slipstream.schemas import ToolEvent
from slipstream.toolcalls import MalformedCall, Renderer, ToolCall, ToolResult, ToolTransport, execute, tool_event

_EMPTY = ToolResult(call_id="", name=None, outcome="ok", text="")
NO_ROOM = "no new chunks fit the remaining budget; prune chunks or give your final answer"
_MIN_CALL_TOKENS = 32  # a retrieval call with less room than this is refused as over budget


class TurnRunner:
    """Per-episode state of the calls: chunks seen, events by chunk (to mark pruned results)."""

    def __init__(
        self,
        options: SearchOptions,
        renderer: Renderer,
        count_tokens: Callable[[str], int],
        ctx: EpisodeContext,
        transport: ToolTransport,
    ) -> None:
        self.options = options
        self.renderer = renderer
        self.count_tokens = count_tokens  # the env's token estimate, the unit of every budget
        self.ctx = ctx
        self.transport = transport
        self.seen: dict[str, None] = {}  # every chunk id returned so far, in order
        self.events: dict[str, ToolEvent] = {}  # chunk id -> the event that returned it
        self.pruned: set[str] = set()

    async def turn(
        self, items: tuple[ToolCall | MalformedCall, ...], thread: Thread, view: View, turn: int
    ) -> tuple[str, Thread]:
        """Run a turn's calls; returns the observation text and the sample to append it to (a new
        one when the turn pruned). Prunes run first, so the turn's other calls are budgeted, and
        checked against the hard cutoff, on the context as pruned."""
        o = self.options
        caller = thread.sample_id  # the sample holding the calls (a prune continues in a new one)
        results: dict[int, ToolResult] = {}
        prune_ids: set[str] = set()
        pruned_by: dict[int, list[str]] = {}
        visible = set(view.visible_chunks())
        for n, item in enumerate(items):
            if isinstance(item, ToolCall) and item.name == PRUNE:
                before = set(prune_ids)
                results[n] = self._prune(item, visible, prune_ids)
                pruned_by[n] = [c for c in dict.fromkeys(item.arguments["chunk_ids"]) if c in prune_ids - before]
        if prune_ids:
            thread = self.ctx.branch(thread, view.pruned(prune_ids), edit="prune")

        for n, item in enumerate(items):
            if isinstance(item, MalformedCall):
                results[n] = ToolResult(
                    call_id=item.id, name=item.name, outcome="invalid_tool_call", text=item.error, kind=item.kind
                )
        used = len(thread)
        count = self.count_tokens
        render = self.renderer.render
        status_cost = count(usage_line(o.budget_tokens, o.budget_tokens)) + count(SOFT_MESSAGE)
        # What the turn's other results (prunes, errors) cost is known exactly; each retrieval
        # result adds its <result></result> wrapper around its chunk blocks.
        known = count(render(self.renderer.result_messages(list(results.values()))))
        retrieval = [n for n, i in enumerate(items) if isinstance(i, ToolCall) and i.name in RETRIEVAL_TOOLS]
        wrapper = count(render(self.renderer.result_messages([_EMPTY])))
        allowed = o.budget_tokens - o.reserve_tokens - used - status_cost - known - wrapper * len(retrieval)
        share = allowed // max(1, len(retrieval))
        # A search or grep returns at most S_budget (`search_tokens`); a read is cut to the
        # remaining budget only (Context-1: "chunks reranked and truncated to the remaining budget").
        budgets = {n: share if items[n].name == READ else min(o.search_tokens, share) for n in retrieval}
        per_call = min(budgets.values(), default=share)
        past_cutoff = used >= o.hard_cutoff * o.budget_tokens
        refuse = past_cutoff or per_call < _MIN_CALL_TOKENS

        calls: list[tuple[int, ToolCall]] = []
        for n in retrieval:
            item = items[n]
            assert isinstance(item, ToolCall)
            if refuse:
                self.ctx.count("budget_refusals")
                text = refusal(item.name, "past the hard cutoff" if past_cutoff else "no room left")
                results[n] = ToolResult(
                    call_id=item.id, name=item.name, outcome="invalid_tool_call", text=text, kind="budget_refused"
                )
            else:
                calls.append((n, self._with_hidden(item, budgets[n], view)))
        done = await execute([c for _, c in calls], self.transport)
        for (n, _), result in zip(calls, done, strict=True):
            results[n] = _trimmed(result, budgets[n], count)

        for n, item in enumerate(items):
            event = tool_event(item, results[n], sample_id=caller, turn=turn)
            if pruned_by.get(n):
                event.info["pruned"] = ",".join(pruned_by[n])  # what prune accuracy is judged on
            ids = [cid for cid, _ in chunk_blocks(results[n].text)] if results[n].outcome == "ok" else []
            if ids and isinstance(item, ToolCall) and item.name in RETRIEVAL_TOOLS:
                event.info["chunks"] = ",".join(ids)
                for cid in ids:
                    self.seen.setdefault(cid, None)
                    self.events[cid] = event
            if results[n].kind == "budget_refused":
                event.info["refused"] = "hard_cutoff" if past_cutoff else "no_room"
            self.ctx.log_tool(event)
        self._mark_hidden(prune_ids)
        rendered = self.renderer.render(self.renderer.result_messages([results[n] for n in range(len(items))]))
        return rendered, thread

    def _with_hidden(self, call: ToolCall, budget: int, view: View) -> ToolCall:
        """The call as the backend gets it: the model's arguments plus the hidden ones."""
        args: dict[str, Any] = dict(call.arguments)
        if call.name == READ:
            # A read may bring back a pruned chunk; only what is in view now is excluded.
            args["_exclude"] = view.visible_chunks()
            args["_query"] = self.ctx.task.metadata.get("question", "")
        else:
            args["_exclude"] = list(self.seen)
        args["_budget"] = budget
        return ToolCall(id=call.id, name=call.name, arguments=args, raw=call.raw)

    def _prune(self, call: ToolCall, visible: set[str], prune_ids: set[str]) -> ToolResult:
        asked = list(dict.fromkeys(call.arguments["chunk_ids"]))
        valid = [c for c in asked if c in visible and c not in prune_ids]
        unknown = [c for c in asked if c not in valid]
        if not valid:
            text = f"error: invalid arguments for {PRUNE}: none of {', '.join(asked)} is in your context"
            return ToolResult(call_id=call.id, name=PRUNE, outcome="invalid_tool_call", text=text, kind="bad_arguments")
        prune_ids.update(valid)
        self.pruned.update(valid)
        text = f"pruned {len(valid)} chunk(s)" + (f"; not in context: {', '.join(unknown)}" if unknown else "")
        return ToolResult(call_id=call.id, name=PRUNE, outcome="ok", text=text)

    def _mark_hidden(self, pruned: set[str]) -> None:
        for cid in pruned:
            event = self.events.get(cid)
            if event is not None and all(c in self.pruned for c in event.info.get("chunks", "").split(",")):
                event.hidden = True


def _trimmed(result: ToolResult, budget: int, count: Any) -> ToolResult:
    """Whole chunks, best first, while the result text fits `budget` tokens (the backend's cut is
    on chunk text; the tags around each chunk are counted here)."""
    if result.outcome != "ok":
        return result
    blocks = chunk_blocks(result.text)
    if not blocks:
        return result
    kept: list[str] = []
    for _, block in blocks:
        if count("".join(kept) + block) > budget:
            break
        kept.append(block)
    text = "".join(kept) if kept else NO_ROOM
    return ToolResult(
        call_id=result.call_id,
        name=result.name,
        outcome=result.outcome,
        text=text,
        kind=result.kind,
        elapsed_s=result.elapsed_s,
        attempts=result.attempts,
        served_by=result.served_by,
    )
