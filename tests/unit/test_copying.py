"""The dense copy curriculum (libs/supervised copying.py) and its place in the warm-start."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.engine import ByteTokenizer, build_tiny
from slipstream.envs import get_env
from slipstream.supervised.copying import ALPHABET, copy_example, copy_examples
from slipstream.supervised.warmstart import copy_pretrain, sft_warmstart

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()


def test_a_copy_example_trains_exactly_the_second_copy_of_its_source() -> None:
    rng = random.Random(3)
    for _ in range(50):
        ids, trained = copy_example(TOK, rng)
        assert len(ids) == len(trained) and ids[0] == TOK.bos_id and ids[-1] == TOK.eos_id
        text = TOK.decode(ids[1:-1])
        noise, source, copied = text.split("|")
        assert copied == source + "\n" and 12 <= len(source) <= 30 and len(noise) <= 20
        assert set(source) <= set(ALPHABET) and set(noise) <= set(ALPHABET + " ")
        # Trained: the copy, its newline and the eos; nothing of the noise or the source.
        first = trained.index(True)
        assert all(trained[first:]) and not any(trained[:first])
        assert TOK.decode(ids[first:-1]) == source + "\n"


def test_copy_examples_are_seeded_and_arguments_are_checked() -> None:
    assert copy_examples(TOK, 8, seed=1) == copy_examples(TOK, 8, seed=1)
    assert copy_examples(TOK, 8, seed=1) != copy_examples(TOK, 8, seed=2)
    assert {TOK.decode(ids)[1] for ids, _ in copy_examples(TOK, 40, seed=0, alphabet="xy")} <= set("xy |")
    rng = random.Random(0)
    for bad, match in (
        ({"alphabet": ""}, "alphabet"),
        ({"min_len": 0}, "min_len"),
        ({"min_len": 5, "max_len": 4}, "min_len"),
        ({"max_noise": -1}, "max_noise"),
    ):
        with pytest.raises(ValueError, match=match):
            copy_example(TOK, rng, **bad)  # type: ignore[arg-type]


def test_copy_pretrain_stops_at_its_target_or_its_cap_and_reports_it() -> None:
    m, _ = build_tiny("micro", seed=0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    out = copy_pretrain(m, TOK, steps=6, batch_size=4, seed=0, check_every=3)
    # Six steps are far from the cliff: it runs to the cap and says so.
    assert (out["steps"], out["reached"], out["copy_accuracy"]) == (6, False, 0.0)
    assert out["loss_last"] < out["loss_first"] and not m.training
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    # A target of 0: no check, every step runs.
    m, _ = build_tiny("micro", seed=0)
    assert copy_pretrain(m, TOK, steps=2, batch_size=2, target_accuracy=0.0)["steps"] == 2
    for bad, match in (
        ({"steps": 0}, "steps"),
        ({"target_accuracy": 1.5}, "target_accuracy"),
        ({"check_every": 0}, "check_every"),
    ):
        with pytest.raises(ValueError, match=match):
            copy_pretrain(m, TOK, **{"steps": 2, **bad})  # type: ignore[arg-type]


def test_the_warm_start_runs_the_curriculum_first_and_mixes_copy_rows_into_its_batches() -> None:
    env = get_env("reverse", min_len=3, max_len=3)
    m, _ = build_tiny("micro", seed=1)
    plain = sft_warmstart(m, TOK, env, steps=4, batch_size=4, seed=0)
    m, _ = build_tiny("micro", seed=1)
    mixed = sft_warmstart(m, TOK, env, steps=4, batch_size=4, seed=0, copy_steps=3, copy_rows=2)
    assert "copy" not in plain and mixed["copy"]["steps"] == 3
    # Each step also trains two copy rows: 14 to 32 more trained tokens per row (source, "\n", eos).
    extra = mixed["tokens"] - plain["tokens"]
    assert 4 * 2 * 14 <= extra <= 4 * 2 * 32
    assert mixed["examples"] == plain["examples"] == 16  # env examples, as before
    with pytest.raises(ValueError, match="copy_steps and copy_rows"):
        sft_warmstart(m, TOK, env, steps=4, copy_rows=-1)
