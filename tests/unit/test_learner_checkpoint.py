"""Learner checkpoints (local object store), the weight hand-off, the ledger and the outcome log."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection

from slipstream.engine import ModelConfig, build_tiny
from slipstream.engine.presets import PRESETS
from slipstream.learner.checkpoint import CheckpointError, Checkpoints, restore
from slipstream.learner.config import LearnerSection
from slipstream.learner.handoff import WeightHandoff
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.outcomes import Outcome, OutcomeLog, read_outcomes
from slipstream.learner.trainer import Trainer
from slipstream.learner.version_state import unique_state
from slipstream.rl import LossConfig
from slipstream.store import LocalObjectStore
from slipstream.weights.staging import list_staged, load_staged

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def stepped_trainer(seed: int = 0, lr: float = 1e-3, preset: str | ModelConfig = "tiny") -> Trainer:
    """A trainer whose AdamW has state (one step on a made-up gradient)."""
    model, tok = build_tiny(preset, seed=seed)
    t = Trainer(model, LearnerSection(lr=lr), LossConfig(), pad_id=tok.pad_id)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    return t


def save(c: Checkpoints, t: Trainer, step: int, ids: list[str], dropped: dict[str, int] | None = None) -> str:
    return c.save(
        step=step,
        policy_version=step + 10,
        model=t.model,
        optimizer=t.optimizer,
        dropped=dropped or {},
        trained_ids=ids,
    )


def test_a_checkpoint_restores_model_optimizer_rng_and_counts(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    c = Checkpoints(store, "run", keep=3)
    assert c.load_latest() is None and c.latest_step() == -1
    t = stepped_trainer(seed=0)
    random.seed(7)
    torch.manual_seed(7)
    save(c, t, 4, ["a", "b"], {"stale": 2})
    expected_py, expected_torch = random.random(), torch.rand(3)

    fresh = stepped_trainer(seed=1, lr=0.5)  # other weights, other optimizer state, other lr
    ckpt = c.load_latest()
    assert ckpt is not None
    assert (ckpt.meta.step, ckpt.meta.policy_version, ckpt.meta.dropped) == (4, 14, {"stale": 2})
    assert ckpt.chain_ids == [["a", "b"]]
    restore(ckpt, fresh.model, fresh.optimizer)
    for k, v in t.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    saved, loaded = t.optimizer.state_dict(), fresh.optimizer.state_dict()
    for idx, st in saved["state"].items():
        assert torch.equal(loaded["state"][idx]["exp_avg"], st["exp_avg"])
    assert fresh.optimizer.param_groups[0]["lr"] == 0.5  # the configured lr wins over the checkpoint's
    assert random.random() == expected_py and torch.equal(torch.rand(3), expected_torch)


def test_the_pointer_keeps_a_chain_and_older_checkpoints_are_pruned(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    c = Checkpoints(store, "run", keep=2)
    t = stepped_trainer()
    for step in (2, 4, 6):
        save(c, t, step, [f"t{step}a", f"t{step}b"])
    prefixes = sorted({k.rsplit("/", 1)[0] for k in store.list("checkpoints/run/step-")})
    assert prefixes == ["checkpoints/run/step-00000004", "checkpoints/run/step-00000006"]
    ckpt = c.load_latest()
    assert ckpt is not None and ckpt.meta.step == 6
    assert ckpt.chain_ids == [["t4a", "t4b"], ["t6a", "t6b"]]  # oldest first: the ledger's windows
    with pytest.raises(CheckpointError, match="not after the committed step 6"):
        save(c, t, 6, [])


def test_files_of_an_uncommitted_checkpoint_are_never_read_and_get_replaced(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    c = Checkpoints(store, "run", keep=3)
    t = stepped_trainer()
    save(c, t, 2, ["a"])
    # A learner died while writing step 4: files, even its meta, but no pointer.
    store.put("checkpoints/run/step-00000004/meta.json", b"{half")
    store.put("checkpoints/run/step-00000005/model.safetensors", b"junk")
    ckpt = c.load_latest()
    assert ckpt is not None and ckpt.meta.step == 2
    save(c, t, 4, ["b"])
    assert sorted({k.rsplit("/", 1)[0] for k in store.list("checkpoints/run/step-")}) == [
        "checkpoints/run/step-00000002",
        "checkpoints/run/step-00000004",
    ]
    again = c.load_latest()
    assert again is not None and again.chain_ids == [["a"], ["b"]]


def test_a_corrupted_or_missing_committed_file_is_an_error_naming_it(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    c = Checkpoints(store, "run", keep=3)
    save(c, stepped_trainer(), 3, ["a"])
    key = "checkpoints/run/step-00000003/optimizer.pt"
    store.put(key, store.get(key)[:-1] + b"x")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt does not match the sha256"):
        c.load_latest()
    store.delete(key)
    with pytest.raises(CheckpointError, match=r"step-00000003/optimizer\.pt is missing"):
        c.load_latest()


def test_tied_embeddings_are_saved_once_and_restored(tmp_path: Path) -> None:
    import msgspec

    tied = msgspec.structs.replace(PRESETS["tiny"], tie_word_embeddings=True)
    t = stepped_trainer(preset=tied)
    assert "lm_head.weight" in t.model.state_dict() and "lm_head.weight" not in unique_state(t.model)
    c = Checkpoints(LocalObjectStore(tmp_path), "run", keep=1)
    save(c, t, 1, [])
    other = stepped_trainer(seed=5, preset=tied)
    ckpt = c.load_latest()
    assert ckpt is not None
    restore(ckpt, other.model, other.optimizer)
    assert torch.equal(other.model.lm_head.weight, t.model.model.embed_tokens.weight)
    assert other.model.lm_head.weight is other.model.model.embed_tokens.weight  # still tied


def test_restore_rejects_a_checkpoint_of_another_model(tmp_path: Path) -> None:
    import msgspec

    c = Checkpoints(LocalObjectStore(tmp_path), "run", keep=1)
    save(c, stepped_trainer(), 1, [])
    wider = msgspec.structs.replace(PRESETS["tiny"], num_hidden_layers=5)
    other = stepped_trainer(preset=wider)
    ckpt = c.load_latest()
    assert ckpt is not None
    with pytest.raises(CheckpointError, match=r"does not fit the model: missing \['model\.layers\.4\."):
        restore(ckpt, other.model, other.optimizer)


def test_the_handoff_stages_versions_in_the_configured_dtype(tmp_path: Path) -> None:
    model, _ = build_tiny("tiny", seed=0)
    h = WeightHandoff(tmp_path / "staging", dtype="bfloat16")
    assert h.highest_staged() == -1
    h.stage(0, model, step_finished_at=123.0)
    h.stage(1, model)
    staged = list_staged(tmp_path / "staging")
    assert [s.version for s in staged] == [0, 1] and staged[0].step_finished_at == 123.0
    assert h.highest_staged() == 1
    tensors = load_staged(staged[0])
    assert set(tensors) == set(model.state_dict())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    full = WeightHandoff(tmp_path / "f")
    full.stage(0, model)
    got = load_staged(list_staged(tmp_path / "f")[0])
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="int8"):
        WeightHandoff(tmp_path, dtype="int8")


def test_the_ledger_forgets_the_oldest_window() -> None:
    ledger = TrainedLedger(2)
    ledger.commit(["a", "b"])
    ledger.commit(["c"])
    assert "a" in ledger and "c" in ledger and len(ledger) == 3
    ledger.commit(["d"])
    assert "a" not in ledger and "c" in ledger and "d" in ledger


def test_the_outcome_log_appends_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "outcomes.jsonl"
    log = OutcomeLog(path)
    log.write([Outcome(trajectory_id="a", outcome="trained", step=3, policy_version=4)])
    log.write(iter([Outcome(trajectory_id="b", outcome="dropped", reason="stale")]))
    log.write([])
    got = read_outcomes(path)
    assert [(o.trajectory_id, o.outcome, o.reason, o.step) for o in got] == [
        ("a", "trained", "", 3),
        ("b", "dropped", "stale", 0),
    ]
    assert all(o.pid > 0 and o.at > 0 for o in got)
    OutcomeLog("").write([Outcome(trajectory_id="x", outcome="trained")])  # off: writes nothing, no error


def test_a_resume_writes_the_trained_lines_its_checkpoint_holds_and_the_log_lacks(tmp_path: Path) -> None:
    # A learner killed between its checkpoint commit and the log write: "b" and "c" have no line,
    # and the kill cut a line short (no newline). "a" was written; "c" was dropped once before
    # (a stale copy), which is no trained line.
    path = tmp_path / "outcomes.jsonl"
    log = OutcomeLog(path)
    log.write([Outcome(trajectory_id="a", outcome="trained", step=6, policy_version=7, sequences=[1])])
    log.write([Outcome(trajectory_id="c", outcome="dropped", reason="stale", step=5, sequences=[9])])
    with path.open("ab") as fh:
        fh.write(b'{"trajectory_id":"b","outcome":"tra')
    ids, seqs = ["a", "b", "c"], [[1], [2, 5], [3]]
    assert log.restore_trained(ids, seqs, step=6, policy_version=7) == 2
    lines = path.read_bytes().splitlines()
    assert lines[2] == b'{"trajectory_id":"b","outcome":"tra'  # closed, left for the audit to see
    restored = [msgspec.json.decode(line, type=Outcome) for line in lines[3:]]
    assert [(o.trajectory_id, o.outcome, o.step, o.policy_version, o.sequences) for o in restored] == [
        ("b", "trained", 6, 7, [2, 5]),
        ("c", "trained", 6, 7, [3]),
    ]
    assert log.restore_trained(ids, seqs, step=6, policy_version=7) == 0  # idempotent
    assert len(path.read_bytes().splitlines()) == 5
    # A checkpoint written before sequences were kept: the lines carry none.
    assert OutcomeLog(tmp_path / "new.jsonl").restore_trained(["x"], [], step=1, policy_version=1) == 1
    assert read_outcomes(tmp_path / "new.jsonl")[0].sequences == []
    assert OutcomeLog("").restore_trained(["x"], [[1]], step=1, policy_version=1) == 0  # off


def test_a_lora_checkpoint_holds_adapters_and_their_optimizer_state_only(tmp_path: Path) -> None:
    from slipstream.engine.lora import adapter_state, attach_lora

    def lora_trainer(seed: int) -> Trainer:
        model, tok = build_tiny("tiny", seed=0)  # the same frozen base in every process
        attach_lora(model, rank=4, alpha=8.0, targets=["q_proj", "v_proj"], seed=seed)
        t = Trainer(model, LearnerSection(lr=1e-3), LossConfig(), pad_id=tok.pad_id)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, 0.01 * (seed + 1))
        t.optimizer.step()
        return t

    c = Checkpoints(LocalObjectStore(tmp_path), "run", keep=3)
    t = lora_trainer(seed=0)
    save(c, t, 2, ["a"])
    ckpt = c.load_latest()
    assert ckpt is not None
    adapters = adapter_state(t.model)
    assert sorted(ckpt.model_state) == sorted(adapters)  # no base weights in the checkpoint
    assert len(ckpt.optimizer_state["state"]) == len(adapters)
    fresh = lora_trainer(seed=5)
    restore(ckpt, fresh.model, fresh.optimizer)
    for name, value in adapters.items():
        assert torch.equal(adapter_state(fresh.model)[name], value), name
    saved, loaded = t.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(loaded[i]["exp_avg"], s["exp_avg"]) for i, s in saved.items())


def test_sharded_files_pass_through_the_shared_dir_and_a_rank_that_cannot_see_it_is_named(tmp_path: Path) -> None:
    # `[learner] shared_dir`: ranks on other nodes write their DCP shards into the directory the driver
    # made, so it must be one every node mounts; the driver reads them back from there.
    from slipstream.learner.ranks import RankError, RankWorker
    from slipstream.learner.sharded_checkpoint import save_state

    shared = tmp_path / "shared"
    shared.mkdir()
    c = Checkpoints(LocalObjectStore(tmp_path / "store"), "run", keep=1, scratch_dir=str(shared))
    t = stepped_trainer(seed=0)
    seen: list[Path] = []

    def writer(path: Path) -> None:
        seen.append(path)
        save_state(t.model, t.optimizer, path)

    c.save(step=1, policy_version=1, model=t.model, optimizer=None, sharded=writer, dropped={}, trained_ids=[])
    assert seen and seen[0].parent == shared and not seen[0].exists()  # made there, removed after
    ckpt = c.load_latest()
    assert ckpt is not None and ckpt.sharded

    worker = RankWorker(1, 2, None, LearnerSection(ranks=2), LossConfig())  # type: ignore[arg-type]
    with pytest.raises(RankError, match=r"rank 1 on .* cannot see the checkpoint directory .*\[learner\] shared_dir"):
        worker.save(str(tmp_path / "made-on-another-node"))
