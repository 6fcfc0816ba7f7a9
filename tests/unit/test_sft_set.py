"""Rejection-sampling fine-tuning: the learner's SFT export, its reader, and a warm-start from it."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch

from slipstream.engine import build_tiny
from slipstream.envs import get_env
from slipstream.learner.sft_export import SftExport
from slipstream.run import load, service_env
from slipstream.run.plan import SFT_SET
from slipstream.schemas import Episode, PolicySegment, Sample, ScoredEpisode, pack_floats, pack_ids, pack_mask
from slipstream.supervised.expert import episode_examples
from slipstream.supervised.sft_set import SftSetError, read_sft_set, sft_set_examples
from slipstream.supervised.warmstart import sft_warmstart

pytestmark = pytest.mark.unit


def scored(
    eid: str, reward: float, *, answer: bytes = b"7\n", split: str = "train", env: str = "chatty"
) -> ScoredEpisode:
    """A one-sample episode of prompt '3+4=' (bos first) and `answer` + eos, byte ids as the tiny tokenizer's."""
    _, tok = _tiny()
    prompt = [tok.bos_id, *tok.encode("3+4=")]
    completion = [*tok.encode(answer.decode()), tok.eos_id]
    sample = Sample(
        sample_id=f"{eid}/0",
        prompt_len=len(prompt),
        token_ids=pack_ids(prompt + completion),
        logprobs=pack_floats([-math.log(2.0)] * len(completion)),
        loss_mask=pack_mask([1] * len(completion)),
        segments=[PolicySegment(3, len(completion))],
    )
    ep = Episode(episode_id=eid, task_id=f"t-{eid}", env=env, group_id="g", group_size=2, samples=[sample], split=split)
    return ScoredEpisode(episode=ep, reward=reward, components={"correct": reward}, correct=reward >= 1.0)


_TINY: list[object] = []


def _tiny() -> tuple[object, object]:
    if not _TINY:
        _TINY.extend(build_tiny("tiny", seed=0))
    return _TINY[0], _TINY[1]  # type: ignore[return-value]


def test_the_export_keeps_train_episodes_at_or_above_the_threshold(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    export = SftExport(path, min_reward=1.0)
    batch = [scored("a", 1.0), scored("b", 0.0), scored("c", 1.1), scored("d", 1.0, split="heldout"), scored("e", 0.99)]
    assert export.write(batch) == 2 and export.write([scored("f", 1.0)]) == 1
    assert [s.episode.episode_id for s in read_sft_set(path)] == ["a", "c", "f"]
    assert read_sft_set(path)[0] == batch[0]  # the wire record, bytes and all
    assert SftExport(None, 1.0).write(batch) == 0 and export.exported == 3
    with pytest.raises(ValueError, match="sft_export_min_reward must be finite, got nan"):
        SftExport(path, math.nan)


def test_the_reader_skips_a_torn_last_line_and_names_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    SftExport(path, 0.0).write([scored("a", 1.0), scored("b", 1.0)])
    whole = path.read_bytes()
    path.write_bytes(whole + whole[:40])  # a learner killed mid-write
    assert [s.episode.episode_id for s in read_sft_set(path)] == ["a", "b"]
    path.write_bytes(whole[:40] + b"\n" + whole)
    with pytest.raises(SftSetError, match=r"sft.jsonl:1: not a ScoredEpisode line"):
        read_sft_set(path)
    with pytest.raises(SftSetError, match="cannot read the SFT set"):
        read_sft_set(tmp_path / "missing.jsonl")


def test_rows_are_the_sampled_tokens_of_the_kept_episodes(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    a, b = scored("a", 1.0), scored("b", 1.0, answer=b"7, since that is the sum\n")
    SftExport(path, 1.0).write([a, b])
    rows = sft_set_examples(path, env="chatty")
    assert rows == episode_examples(a.episode) + episode_examples(b.episode)
    ids, trained = rows[0]
    assert len(ids) == 8 and trained == [False] * 5 + [True] * 3  # bos 3+4= | 7 \n eos
    with pytest.raises(SftSetError, match=r"episodes of \['chatty'\], but this run trains 'arith'"):
        sft_set_examples(path, env="arith")
    with pytest.raises(SftSetError, match=r"no training rows \(2 episodes, 0 kept\)"):
        sft_set_examples(path, env="chatty", min_reward=2.0)


def test_a_warm_start_from_an_sft_set_learns_its_answers() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = build_tiny("micro", seed=0)
        rows = [episode_examples(scored(str(i), 1.0).episode)[0] for i in range(4)]
        env = get_env("chatty")
        before = sft_warmstart(model, tok, env, steps=1, batch_size=4, lr=1e-9, rows=rows)
        after = sft_warmstart(model, tok, env, steps=12, batch_size=4, lr=1e-2, rows=rows, warmup_steps=1)
        with pytest.raises(ValueError, match="an SFT set needs at least one example"):
            sft_warmstart(model, tok, env, steps=1, rows=[])
    finally:
        torch.set_num_threads(threads)
    # Four copies of "7\n" + eos: the loss over their 3 trained tokens falls from ~ln(259) = 5.6.
    assert before["loss_first"] > 4.0 and after["loss_last"] < 0.5 * before["loss_first"]
    assert after["examples"] == 12 * 4


def test_the_run_file_exports_and_warm_starts_from_a_set(tmp_path: Path) -> None:
    run = tmp_path / "rft.toml"
    run.write_text(
        'name = "rft"\n[env]\nname = "chatty"\n[warmstart]\nsft_from = "runs/a"\n[learner]\nsft_export = true\n'
    )
    plan = load(run).plan()
    assert (plan.sft_from, plan.sft_export, plan.sft_export_min_reward) == ("runs/a", True, 1.0)
    env = service_env(plan, Path("/m"), Path("/s"), tmp_path / "learner-outcomes.jsonl")
    assert env["SLIPSTREAM_LEARNER__SFT_EXPORT_PATH"] == str(tmp_path / SFT_SET)
    assert env["SLIPSTREAM_LEARNER__SFT_EXPORT_MIN_REWARD"] == "1.0"
    off = msgspec.structs.replace(plan, sft_export=False)
    assert "SLIPSTREAM_LEARNER__SFT_EXPORT_PATH" not in service_env(off, Path("/m"), Path("/s"), tmp_path / "o.jsonl")
