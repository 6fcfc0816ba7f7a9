"""`slipstream serve` as a user runs it: one command, a printed URL, the real `openai` client.

The command runs as its own process on a free port (`--port 0`) and its first stdout line names
the URL. Through it: `models.list` / `models.retrieve` (and a 404 naming an unknown model), and a
streamed chat whose first token arrives well before its last (tokens are written as the engine
samples them, not replayed after the whole completion), whose deltas add up to exactly the text
of the same call not streamed (greedy); `top_logprobs` streamed and not; and on SIGTERM every
session is flushed into episodes in the `--record` store. A bad model name fails in one line before anything loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SERVE = [sys.executable, "-m", "slipstream.cli", "serve"]
MODEL = "tiny"
TOKENS = 192


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[str], Path]]:
    record = tmp_path_factory.mktemp("served")
    log = record.parent / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*SERVE, MODEL, "--port", "0", "--max-batch", "4", "--record", str(record)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ),
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"serving {MODEL} at http://127.0.0.1:"), line + log.read_text()
        yield line.split(" at ", 1)[1].strip(), proc, record
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=60)


def test_models_list_and_retrieve(server: tuple[str, subprocess.Popen[str], Path]) -> None:
    client = openai.OpenAI(base_url=server[0], api_key="sk-a", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    got = client.models.retrieve(MODEL)
    assert (got.id, got.object, got.owned_by) == (MODEL, "model", "slipstream")
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here; this endpoint serves 'tiny'"):
        client.models.retrieve("gpt-4")


def test_a_stream_sends_its_first_token_well_before_its_last(server: tuple[str, subprocess.Popen[str], Path]) -> None:
    client = openai.OpenAI(base_url=server[0], api_key="sk-b", max_retries=0)
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count: 1 2 3"}],
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    t0 = time.monotonic()
    arrivals: list[float] = []
    pieces: list[str] = []
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True, logprobs=True):  # type: ignore[call-overload]
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        if choice.logprobs is not None and choice.logprobs.content:
            arrivals.append(time.monotonic() - t0)
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
    assert finish == "length"
    assert len(arrivals) == TOKENS  # one chunk per token, each with its log-prob
    first, last = arrivals[0], arrivals[-1]
    assert first < 0.5 * last, f"first token at {first:.3f}s, last at {last:.3f}s: not streamed as generated"
    assert "".join(pieces) == whole.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_answer_the_likeliest_tokens(
    server: tuple[str, subprocess.Popen[str], Path], stream: bool
) -> None:
    client = openai.OpenAI(base_url=server[0], api_key="sk-c", max_retries=0)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "abc"}], "max_tokens": 8, "temperature": 0.0}
    if stream:
        entries = [
            e
            for chunk in client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True)  # type: ignore[call-overload]
            if chunk.choices and chunk.choices[0].logprobs is not None
            for e in chunk.choices[0].logprobs.content or []
        ]
    else:
        resp = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)  # type: ignore[call-overload]
        entries = resp.choices[0].logprobs.content
    assert len(entries) == 8
    for e in entries:
        tops = e.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        # Greedy: the sampled token is the likeliest, and its recomputed log-prob is its recorded one.
        assert tops[0].token == e.token
        assert abs(tops[0].logprob - e.logprob) < 1e-4


def test_sigterm_flushes_the_session_into_recorded_episodes(server: tuple[str, subprocess.Popen[str], Path]) -> None:
    """Last against the server: stopping it writes the streamed session's calls as an episode."""
    from slipstream.schemas import Episode, decode
    from slipstream.store import LocalObjectStore

    _, proc, record = server
    proc.terminate()
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    store = LocalObjectStore(record)
    keys = store.list("")
    episodes = [decode(store.get(k), Episode) for k in keys]
    calls = sorted(len(e.samples) for e in episodes)
    # sk-b's session: the whole call and the streamed one; sk-c's: two top_logprobs calls; sk-a only listed models
    assert calls == [2, 2], keys
    longest = max((smp for e in episodes for smp in e.samples), key=lambda smp: len(smp.ids()) - smp.prompt_len)
    assert len(longest.ids()) - longest.prompt_len == TOKENS


def test_a_bad_model_name_is_one_line_and_nothing_starts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "serve", "llama-70b", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(
        "slipstream serve: unknown model 'llama-70b': not a named model (known: smollm2-135m)"
    )
    assert proc.stderr.count("\n") == 1


def test_print_config_resolves_a_run_files_model_and_endpoint(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(
        'name = "r"\n[model]\npreset = "micro"\n[endpoint]\nport = 0\nmodel_name = "m1"\nrenderer = "tags"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "serve", str(run), "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["model"]["preset"] == "micro"
    assert (cfg["endpoint"]["port"], cfg["endpoint"]["model_name"], cfg["endpoint"]["renderer"]) == (0, "m1", "tags")
    assert cfg["serve"]["run_id"] == "r"
