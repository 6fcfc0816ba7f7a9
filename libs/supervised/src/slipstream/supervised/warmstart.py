"""Supervised warm-start: a short cross-entropy phase on an env's reference completions.

RL needs a policy that sometimes succeeds (a group whose rewards are all equal carries no
signal), and a randomly initialised tiny model never does. `slipstream demo` therefore runs a few
seconds of supervised training on `env.sft_example(task)` for train-split tasks first, stopping
well short of mastery so RL has room to improve held-out accuracy.

The sequence is laid out exactly as a rollout lays it out ([bos] + prompt + completion + eos,
see libs/harness rollout.py), and the loss covers only the completion tokens and the eos.

Multi-turn environments (`env.warmstart_from_expert`) warm-start from their scripted expert
instead: `expert_examples` plays `env.expert` through the real harness (scripted.py), and the
loss covers exactly the tokens the expert "sampled" in its trainable samples (loss mask 1) —
never the prompt or the tool results — as Context-1 warm-starts from a stronger policy's
trajectories.

`summary` plays those expert episodes with context restarts (libs/harness summary.py), so the
model also learns to write summaries and to go on from a restarted context; given several
configs (a summary and the truncation baseline), task i is played under config i mod n, so one
warm-started model knows every context mode that will be compared.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import Environment, TaskSpec
from slipstream.harness.rollout import prompt_ids
from slipstream.supervised.copying import copy_examples
from slipstream.supervised.expert import (  # noqa: F401  (re-exported: the warm-start's public names)
    EXPERT_CHUNK,
    Example,
    Summaries,
    _Rows,
    episode_examples,
    expert_episodes,
    expert_example_chunks,
    expert_examples,
)

# Defaults measured on the `arith` env (max_operand 19, ops "+") with the tiny preset on one CPU
# thread: see libs/supervised/README.md for the figures.
DEFAULT_STEPS = 200
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 3e-3
# Adam's betas for the copy curriculum: at (0.9, 0.95) (the warm-start's) the micro preset's copy
# cliff fell by 3,000 steps on one seed of two tried (0 and 3), at (0.9, 0.999) on all four (seeds
# 0-3, 1,800-2,400 steps).
COPY_BETAS = (0.9, 0.999)


def sft_sequence(tokenizer: Tokenizer, env: Environment[msgspec.Struct], task: TaskSpec) -> tuple[list[int], int]:
    """(token ids, prompt length) of one supervised example: [bos] + prompt + reference + eos."""
    prompt = prompt_ids(tokenizer, task.prompt)
    completion = [*tokenizer.encode(env.sft_example(task)), tokenizer.eos_id]
    return [*prompt, *completion], len(prompt)


def _batch(
    examples: list[Example], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, T-1], targets [B, T-1] and the trained-target mask [B, T-1]."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width - 1), dtype=torch.bool)
    for i, (seq, trained) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        # Token j is predicted at position j - 1.
        mask[i, : len(seq) - 1] = torch.tensor(trained[1:], dtype=torch.bool)
    ids = ids.to(device)
    return ids[:, :-1], ids[:, 1:], mask.to(device)


def sft_warmstart(
    model: nn.Module,
    tokenizer: Tokenizer,
    env: Environment[msgspec.Struct],
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    warmup_steps: int = 10,
    target_accuracy: float = 0.0,
    probe_tasks: int = 256,
    check_every: int = 2,
    settle_steps: int = 0,
    sampled_target: float = 0.0,
    temperature: float = 1.0,
    summary: Summaries = None,
    copy_steps: int = 0,
    copy_rows: int = 0,
    drill_rows: int = 0,
    on_check: Callable[[int, float, float], None] | None = None,
    pool_tasks: int = 0,
    rows: list[Example] | None = None,
) -> dict[str, Any]:
    """Train `model` in place on up to `steps` batches of train-split reference completions.

    `target_accuracy` > 0 stops as soon as the model's greedy accuracy on `probe_tasks` other
    train-split tasks reaches it (checked every `check_every` steps). Supervised learning of a
    copying skill is a cliff (the `reverse` task with 3-letter words: greedy accuracy ~0.1 after
    150 steps, 1.0 after 250, and where the cliff falls varies by seed: 0.10 to 1.0 at 150 steps
    over five seeds), so a fixed step count lands some seeds before the skill and others past
    mastery; a target lands every seed at the same competence, where RL has signal and room.
    Greedy accuracy is measured teacher-forced in one forward pass (`greedy_success` over
    `probe_items`): for an env with `warmstart_from_expert`, the share of the expert's clean
    episodes (answered right, no invalid call) whose every sampled token is the model's argmax,
    i.e. greedy success on those keys, however imperfect the expert is elsewhere.

    `settle_steps` > 0 (with a target): when the target is not reached after `steps`, training goes
    on for up to that many more steps at the schedule's final lr (10% of `lr`), still probing.
    Where the cliff starts late the copy is often still forming at the cap (lookup, seed 1 on an
    AVX2 host: probe 0.01 -> 0.07 over the cap's last 50 steps); the cosine's length is unchanged,
    so a seed that reaches the target within `steps` trains exactly as without it.

    `sampled_target` > 0 (with a target): the stop also needs the probe's *expected sampled
    success* (`sampled_success` at `temperature`, the rollouts' temperature) to reach it. Greedy
    accuracy says the copies are the argmax, not that sampling keeps them: on lookup (seed 1, AVX2
    host) greedy 0.93 came with held-out sampled success 0.023 at temperature 1, so groups'
    rewards barely differed and RL traded the copies away. Training goes on past the greedy
    target (and into the settle steps) until sampling replays enough expert episodes.

    AdamW with a linear warm-up then cosine decay to 10% of `lr`, gradients clipped to
    `grad_clip`. Tasks come from `env.generate("train", (steps + settle_steps) * batch_size, seed)`
    (the first `steps * batch_size` whatever `settle_steps` is), so the run is
    a function of its arguments (and torch's kernels). The model is left in eval mode. An env
    with `warmstart_from_expert` trains on its expert's episodes (one example per trainable
    sample; a batch is `batch_size` examples).

    `copy_steps` > 0: first up to that many steps of the dense copy curriculum (`copy_pretrain`:
    batches of 16 at its own lr of 3e-3, until half the held copies are exact), which gives a
    model trained from scratch the induction heads a copy from an arbitrary distance needs;
    `copy_rows` > 0 adds that many copy examples to every warm-start batch, so the heads are kept
    while the env's examples are learned (the loss is the mean over every trained token of the
    batch).

    `drill_rows` > 0 adds that many of the env's skill-drill examples (`drill_examples`:
    `Environment.drill_texts`, the target alone trained) to every batch: a skill the teacher's
    episodes need but rarely show (recall: reading a value back from a summary).

    Returns figures: steps (run), examples, tokens (trained), seconds, loss_first / loss_last
    (means over the first / last quarter of the steps, at most 10 each), losses (every step) and,
    with a target, probe_accuracy (the last greedy accuracy measured), reached (bool) and
    probe_curve ([step, accuracy] at every check: where the supervised cliff fell); with a
    sampled target also probe_sampled (the last expected sampled success), and each curve point
    is [step, greedy, sampled]; with copy steps also copy (copy_pretrain's figures).

    `pool_tasks` > 0: the examples come from that many train-split tasks, cycled in order
    (epochs), instead of new tasks for every batch: for an expert whose episodes are costly to
    play (`code`: a bubblewrap sandbox and a test run each, ~11 episodes/s on 2 cores, so a
    2,000-step warm-start of batch 8 would play for 24 minutes before the model saw its last row).

    `rows`: train on these examples (epochs over them, shuffled once by `seed`) instead of the env's references
    or its expert: an SFT set of the policy's own RL episodes (`slipstream.supervised.sft_set`,
    rejection-sampling fine-tuning). The probe and its target are the env's as without them, so
    the stop means the same for both kinds of data.

    `on_check(step, greedy, sampled)` is called after every probe check (sampled is -1 without a
    sampled target): a caller's progress line during a warm-start that can run for minutes.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got steps={steps}, batch_size={batch_size}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not 0.0 <= target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy}")
    if target_accuracy > 0 and (probe_tasks < 1 or check_every < 1):
        raise ValueError(f"probe_tasks and check_every must be >= 1, got {probe_tasks} and {check_every}")
    if settle_steps < 0:
        raise ValueError(f"settle_steps must be >= 0, got {settle_steps}")
    if settle_steps and not target_accuracy > 0:
        raise ValueError("settle_steps needs a target_accuracy > 0 (it extends a warm-start that missed its target)")
    if not 0.0 <= sampled_target <= 1.0:
        raise ValueError(f"sampled_target must be in [0, 1], got {sampled_target}")
    if sampled_target and not target_accuracy > 0:
        raise ValueError("sampled_target needs a target_accuracy > 0 (it is a second condition of the probe's stop)")
    if sampled_target and not temperature > 0:
        raise ValueError(f"temperature must be > 0 with a sampled_target, got {temperature}")
    if pool_tasks < 0:
        raise ValueError(f"pool_tasks must be >= 0, got {pool_tasks}")
    if copy_steps < 0 or copy_rows < 0:
        raise ValueError(f"copy_steps and copy_rows must be >= 0, got {copy_steps} and {copy_rows}")
    if drill_rows < 0:
        raise ValueError(f"drill_rows must be >= 0, got {drill_rows}")
    copy_figures = copy_pretrain(model, tokenizer, steps=copy_steps, seed=seed) if copy_steps else None
    copy_mix = copy_examples(tokenizer, (steps + settle_steps) * copy_rows, seed + 7) if copy_rows else []
    drill_mix = drill_examples(env, tokenizer, (steps + settle_steps) * drill_rows, seed + 11) if drill_rows else []
    tasks = [] if rows is not None else env.generate("train", pool_tasks or (steps + settle_steps) * batch_size, seed)
    if rows is not None:
        if not rows:
            raise ValueError("rows: an SFT set needs at least one example")
        shuffled = list(rows)  # the export is in step order: neighbouring rows share a policy version
        random.Random(seed).shuffle(shuffled)
        examples = _Rows([shuffled], cycle=True)
    elif env.warmstart_from_expert:
        examples = _Rows(expert_example_chunks(env, tokenizer, tasks, summary), cycle=pool_tasks > 0)
    else:
        examples = _Rows([_examples(env, tokenizer, tasks, summary)], cycle=pool_tasks > 0)
    probe: list[list[Example]] = []
    if target_accuracy > 0:
        # Another stream of the train split (not the eval's), so the stop is not tuned on what is reported.
        probe = probe_items(env, tokenizer, env.generate("train", probe_tasks, seed + 1_000_003), summary)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses: list[float] = []
    tokens = 0
    accuracy = -1.0
    sampled = -1.0
    curve: list[list[float]] = []

    def check(step: int) -> bool:
        nonlocal accuracy, sampled
        if sampled_target:
            accuracy, sampled = probe_success(model, probe, tokenizer.pad_id, temperature)
            point = [step, round(accuracy, 4), round(sampled, 4)]
        else:
            accuracy = greedy_success(model, probe, tokenizer.pad_id)
            point = [step, round(accuracy, 4)]
        curve.append(point)
        if on_check is not None:
            on_check(step, accuracy, sampled)
        return accuracy >= target_accuracy and (not sampled_target or sampled >= sampled_target)

    t0 = time.perf_counter()
    reached = False
    model.train()
    try:
        for step in range(steps + settle_steps):
            if probe and step > 0 and step % check_every == 0:
                reached = check(step)
                if reached:
                    break
            rows = examples.take(step * batch_size, (step + 1) * batch_size)
            if not rows:
                raise ValueError(
                    f"warm-start: {env.name}'s examples ran out at step {step} of {steps + settle_steps} (batch "
                    f"{batch_size}); its expert's kept episodes are fewer than the steps need: set pool_tasks "
                    "(sft_pool_tasks) for epochs over them"
                )
            rows = rows + copy_mix[step * copy_rows : (step + 1) * copy_rows]
            rows = rows + drill_mix[step * drill_rows : (step + 1) * drill_rows]
            loss, trained = _train_step(model, opt, sched, rows, tokenizer.pad_id, grad_clip)
            losses.append(loss)
            tokens += trained
    finally:
        model.eval()
        opt.zero_grad(set_to_none=True)
    ran = len(losses)
    if probe and not reached:
        reached = check(ran)
    window = max(1, min(10, ran // 4))
    figures: dict[str, Any] = {
        "steps": ran,
        "examples": ran * batch_size,
        "tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "loss_first": sum(losses[:window]) / window,
        "loss_last": sum(losses[-window:]) / window,
        "losses": losses,
    }
    if probe:
        figures["probe_accuracy"] = accuracy
        figures["reached"] = reached
        figures["probe_curve"] = curve
        if sampled_target:
            figures["probe_sampled"] = sampled
    if copy_figures is not None:
        figures["copy"] = copy_figures
    return figures


def drill_examples(env: Environment[msgspec.Struct], tokenizer: Tokenizer, n: int, seed: int) -> list[Example]:
    """`n` of the env's skill-drill examples (`Environment.drill_texts`): [bos] context, then the target,
    encoded apart so that their ids are those of an episode's, the target alone trained."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    out: list[Example] = []
    for context, target in env.drill_texts(n, seed):
        ids, answer = [*bos, *tokenizer.encode(context)], tokenizer.encode(target)
        out.append(([*ids, *answer], [False] * len(ids) + [True] * len(answer)))
    return out


def copy_pretrain(
    model: nn.Module,
    tokenizer: Tokenizer,
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    grad_clip: float = 0.0,
    warmup_steps: int = 10,
    target_accuracy: float = 0.5,
    check_every: int = 100,
    probe_examples: int = 128,
) -> dict[str, Any]:
    """Train `model` in place on up to `steps` batches of the dense copy curriculum (copying.py),
    stopping once `target_accuracy` of a held set of copy examples (another seed) is copied
    exactly, greedy and teacher-forced (checked every `check_every` steps).

    No gradient clipping by default: at a clip of 1.0 the micro preset's cliff had not fallen
    after 2,000 steps (loss 2.42) where unclipped it had (loss 0.05, 64 % exact copies), seed 0.
    Measured on one CPU thread: ~35 steps/s, the cliff at 1,800-2,400 steps for seeds 0-3.

    Returns steps (run), seconds, loss_first / loss_last (means of the first / last 10 steps),
    copy_accuracy (the last check) and reached, so a run shows whether the induction cliff fell.
    """
    if not 0.0 <= target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got steps={steps}, batch_size={batch_size}")
    examples = copy_examples(tokenizer, steps * batch_size, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=COPY_BETAS, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup_steps))
    held = copy_examples(tokenizer, probe_examples, seed + 1_000_003)
    losses: list[float] = []
    accuracy = 0.0
    reached = False

    t0 = time.perf_counter()
    model.train()
    try:
        for step in range(steps):
            if target_accuracy > 0 and step > 0 and step % check_every == 0:
                accuracy = greedy_accuracy(model, held, tokenizer.pad_id)
                reached = accuracy >= target_accuracy
                if reached:
                    break
            rows = examples[step * batch_size : (step + 1) * batch_size]
            losses.append(_train_step(model, opt, sched, rows, tokenizer.pad_id, grad_clip)[0])
    finally:
        model.eval()
        opt.zero_grad(set_to_none=True)
    if not reached:
        accuracy = greedy_accuracy(model, held, tokenizer.pad_id)
        reached = target_accuracy > 0 and accuracy >= target_accuracy
    ran = len(losses)
    window = max(1, min(10, ran // 4))
    return {
        "steps": ran,
        "seconds": time.perf_counter() - t0,
        "loss_first": sum(losses[:window]) / window,
        "loss_last": sum(losses[-window:]) / window,
        "copy_accuracy": accuracy,
        "reached": reached,
    }


# Rows longer than this, in a batch whose shortest row is under half their length, are batched by
# length: attention costs the square of the padded length, and a swarm batch (an orchestrator's
# ~2,000-token sample among ~400-token sub-agent samples and ~60-token copy rows) padded everything
# to the longest (4 s a step on a loaded machine). Batches of rows of like length are unchanged.
LONG_ROWS = 1024


def _by_length(examples: list[Example]) -> list[int]:
    """The order rows are batched in: as given, unless some row is long (`LONG_ROWS`) and more than
    twice the shortest, then shortest first."""
    lengths = [len(ids) for ids, _ in examples]
    if not lengths or max(lengths) <= LONG_ROWS or max(lengths) <= 2 * min(lengths):
        return list(range(len(examples)))
    return sorted(range(len(examples)), key=lambda i: lengths[i])


def _length_groups(rows: list[Example]) -> list[list[Example]]:
    """`rows` as one batch, or (see `_by_length`) as groups of rows at most twice their shortest."""
    order = _by_length(rows)
    if order == list(range(len(rows))):
        return [rows]
    groups: list[list[Example]] = []
    for i in order:
        if not groups or len(rows[i][0]) > 2 * len(groups[-1][0][0]):
            groups.append([])
        groups[-1].append(rows[i])
    return groups


def _train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    rows: list[Example],
    pad_id: int,
    grad_clip: float,
) -> tuple[float, int]:
    """One supervised step on `rows`: (the loss, the number of trained tokens).

    The loss is the mean over every trained token of the batch; rows of very unlike lengths
    (`_length_groups`) are forwarded in groups whose summed losses make the same mean."""
    device = next(model.parameters()).device
    groups = _length_groups(rows)
    if len(groups) == 1:
        inputs, targets, mask = _batch(rows, pad_id, device)
        loss = F.cross_entropy(model(inputs)[mask].float(), targets[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        value, trained = float(loss.detach()), int(mask.sum())
    else:
        opt.zero_grad(set_to_none=True)
        batches = [_batch(g, pad_id, device) for g in groups]
        trained = sum(int(mask.sum()) for _, _, mask in batches)
        value = 0.0
        for inputs, targets, mask in batches:
            part = F.cross_entropy(model(inputs)[mask].float(), targets[mask], reduction="sum") / max(1, trained)
            part.backward()
            value += float(part.detach())
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], grad_clip)
    opt.step()
    sched.step()
    return value, trained


def _examples(
    env: Environment[msgspec.Struct],
    tokenizer: Tokenizer,
    tasks: list[TaskSpec],
    summary: Summaries = None,
) -> list[Example]:
    if env.warmstart_from_expert:
        return expert_examples(env, tokenizer, tasks, summary)
    out: list[Example] = []
    for t in tasks:
        seq, prompt_len = sft_sequence(tokenizer, env, t)
        out.append((seq, [False] * prompt_len + [True] * (len(seq) - prompt_len)))
    return out


def probe_items(
    env: Environment[msgspec.Struct], tokenizer: Tokenizer, tasks: list[TaskSpec], summary: Summaries = None
) -> list[list[Example]]:
    """What the warm-start's stop is measured on: per task, the examples that must all be argmax-right.

    A single-turn env: its reference completion. An env with `warmstart_from_expert`: the
    expert's episode (its trainable samples; every sampled turn trained, the observations not),
    for the tasks the expert plays cleanly (`env.probe_episode`: by default a right answer and no
    invalid call), so an imperfect expert's guesses and slips (noise no policy should copy token for
    token) do not cap what the probe can reach. Raises ValueError when no task is left.
    """
    if not env.warmstart_from_expert:
        return [[ex] for ex in _examples(env, tokenizer, tasks)]
    episodes = asyncio.run(expert_episodes(env, tokenizer, tasks, summary=summary))
    items = [
        episode_examples(e, frozen=None if env.warmstart_frozen_samples else 0)
        for t, e in zip(tasks, episodes, strict=True)
        if env.probe_episode(t, e)
    ]
    if not items:
        raise ValueError(f"the {env.name!r} expert solved none of the {len(tasks)} probe tasks cleanly")
    return items


def _forward_rows(
    model: nn.Module, examples: list[Example], pad_id: int, batch_size: int
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Teacher-forced logits of `examples`, `batch_size` rows at a time (in `_by_length` order):
    (the rows' indices, logits, targets, trained mask) per batch, in eval mode without gradients,
    the model's mode restored after."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    order = _by_length(examples)
    try:
        for i in range(0, len(order), batch_size):
            idx = order[i : i + batch_size]
            inputs, targets, mask = _batch([examples[j] for j in idx], pad_id, device)
            with torch.no_grad():
                logits = model(inputs)
            yield idx, logits, targets, mask
    finally:
        model.train(was_training)


def _argmax_hits(model: nn.Module, examples: list[Example], pad_id: int, batch_size: int) -> list[bool]:
    """Per example: is every trained token the model's argmax, teacher-forced (model mode kept)."""
    hits = [False] * len(examples)
    for idx, logits, targets, mask in _forward_rows(model, examples, pad_id, batch_size):
        for j, hit in zip(idx, ((logits.argmax(-1) == targets) | ~mask).all(dim=1).tolist(), strict=True):
            hits[j] = bool(hit)
    return hits


def _picked_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float
) -> list[float]:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return [float(x) for x in (logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum(dim=1).tolist()]


def greedy_accuracy(model: nn.Module, examples: list[Example], pad_id: int, batch_size: int = 256) -> float:
    """Fraction of examples whose every trained token is the model's argmax, teacher-forced.

    Argmax decoding reproduces a reference iff the argmax after each reference prefix is the
    next token, so for a single-turn env this is greedy accuracy, slightly stricter (the
    terminator and eos must be argmax too). Leaves the model in the mode it was in.
    """
    hits = _argmax_hits(model, examples, pad_id, batch_size)
    return sum(hits) / len(hits)


def greedy_success(model: nn.Module, items: list[list[Example]], pad_id: int, batch_size: int = 256) -> float:
    """Fraction of items (`probe_items`) all of whose examples are argmax-right, teacher-forced.

    For a multi-turn item (an episode's samples, whose sampled turns are interleaved with the
    observations they got), greedy decoding replays the episode iff every sampled token is
    argmax-right, so this is greedy success on those tasks, in one forward pass per 256 samples.
    """
    hits = iter(_argmax_hits(model, [ex for item in items for ex in item], pad_id, batch_size))
    return sum(all([next(hits) for _ in item]) for item in items) / len(items)


def _sampled_logprobs(
    model: nn.Module, examples: list[Example], pad_id: int, temperature: float, batch_size: int
) -> list[float]:
    """Per example: the log-probability, at `temperature`, of all its trained tokens, teacher-forced."""
    out = [0.0] * len(examples)
    for idx, logits, targets, mask in _forward_rows(model, examples, pad_id, batch_size):
        for j, logp in zip(idx, _picked_logprobs(logits, targets, mask, temperature), strict=True):
            out[j] = logp
    return out


def probe_success(
    model: nn.Module, items: list[list[Example]], pad_id: int, temperature: float = 1.0, batch_size: int = 256
) -> tuple[float, float]:
    """(`greedy_success`, `sampled_success`) of `items` from one forward pass over them, not two:
    the same logits give the argmax and the tempered log-probabilities, so the figures are those
    of the two functions (the warm-start's probe was half its time at 256 items every 25 steps)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    examples = [ex for item in items for ex in item]
    hits = [False] * len(examples)
    logps = [0.0] * len(examples)
    for idx, logits, targets, mask in _forward_rows(model, examples, pad_id, batch_size):
        row_hits = ((logits.argmax(-1) == targets) | ~mask).all(dim=1).tolist()
        for j, hit, logp in zip(idx, row_hits, _picked_logprobs(logits, targets, mask, temperature), strict=True):
            hits[j], logps[j] = bool(hit), logp
    greedy = sampled = 0.0
    k = 0
    for item in items:
        greedy += all(hits[k : k + len(item)])
        sampled += math.exp(sum(logps[k : k + len(item)]))
        k += len(item)
    return greedy / len(items), sampled / len(items)


def sampled_success(
    model: nn.Module, items: list[list[Example]], pad_id: int, temperature: float = 1.0, batch_size: int = 256
) -> float:
    """Expected sampled success on `probe_items`: the mean over items of the probability that
    sampling at `temperature` replays the item exactly, teacher-forced in one forward pass.

    An item's probability is the product, over its examples' trained tokens, of the token's
    probability under softmax(logits / temperature) after its reference prefix (the observations
    in between are the env's, not sampled). It is a lower bound on sampled success on those
    tasks (another right episode also succeeds) and, unlike `greedy_success`, it sees how much
    probability the copies carry: argmax-right tokens at p = 0.6 each leave a 10-token episode
    at 0.006. Leaves the model in the mode it was in.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logps = iter(_sampled_logprobs(model, [ex for item in items for ex in item], pad_id, temperature, batch_size))
    return sum(math.exp(sum(next(logps) for _ in item)) for item in items) / len(items)
