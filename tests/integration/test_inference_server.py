"""The inference server as its own process (`python -m slipstream.serve.inference`), as a pod runs it.

It prints the bound URL, serves HttpEngine (a greedy completion equal to the same seeded model's
in this process, health and stats over plain HTTP), and exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams, build_tiny
from slipstream.serve.http_engine import HttpEngine

pytestmark = pytest.mark.integration


async def test_the_server_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    err = (tmp_path / "stderr").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream.serve.inference", "--server.port", "0", "--model.preset", "tiny"],
        stdout=subprocess.PIPE,
        stderr=err,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        while line and not line.startswith("listening on "):  # log lines may come first
            line = proc.stdout.readline().decode()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert json.load(resp) == {"status": "ok", "policy_version": 0}
        engine = HttpEngine(url)
        await engine.start()
        tok = ByteTokenizer()
        prompt = tok.encode("1+1=")
        res = await engine.generate(
            GenerationRequest(
                request_id="a", prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            )
        )
        await engine.stop()
        model, _ = build_tiny("tiny", seed=0)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert res.completion_ids == ids[len(prompt) :]
        with urllib.request.urlopen(url + "/stats", timeout=10) as resp:
            assert json.load(resp)["stats"]["tokens_generated"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        err.close()
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == 0, (tmp_path / "stderr").read_text()
