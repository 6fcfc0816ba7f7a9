"""A wrong model name or directory in a run file or the flags fails as it loads: one line naming
the file, the line, the bad value and what exists, before anything starts (no traceback).

Model directories here are written by `save_pretrained` from small configs (no download); a
directory whose config.json names an architecture the engine lacks is refused with the engine's
own one-line message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.cli.__main__ import main
from slipstream.engine import ByteTokenizer, build_tiny, save_pretrained
from slipstream.engine.config import ModelConfig
from slipstream.run import RunFileError, load
from slipstream.run.modelcheck import ModelNameError, check_model

pytestmark = pytest.mark.unit

QWEN3: dict[str, object] = {
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 259,
    "tie_word_embeddings": True,
}


def _model_dir(path: Path, raw: dict[str, object] | None = None) -> Path:
    cfg = ModelConfig.from_hf(raw or QWEN3)
    model, _ = build_tiny(cfg, seed=0)
    return save_pretrained(model, ByteTokenizer(), path)


def _run_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\nseed = 0\n\n' + body)
    return path


def test_a_model_path_in_a_run_file_resolves_from_the_run_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_dir(tmp_path / "models" / "q3")
    monkeypatch.chdir("/")  # relative to the run file, not to where the command runs
    plan = load(_run_file(tmp_path, '[model]\npath = "models/q3"\nlora_rank = 0\n')).plan()
    assert plan.model == str(model.resolve())
    assert Path(plan.model).is_absolute()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('[model]\nname = "smollm3"\n', r"run.toml:5: \[model\] unknown model name 'smollm3' \(known: smollm2-135m; "),
        ('[model]\npath = "nowhere"\n', r"run.toml:5: \[model\] unknown model 'nowhere': not a named model \(known: "),
        ('[model]\nname = "smollm2-135m"\npath = "x"\n', r"run.toml:6: \[model\] takes name or path, not both"),
        ('[model]\npath = "empty"\n', r"run.toml:5: \[model\] model directory .*empty has no config.json"),
        (
            '[model]\npath = "gemma"\n',
            r"run.toml:5: \[model\] model directory .*gemma: config.json model_type 'gemma2' is not supported "
            r"\(supported: llama, qwen2, qwen3, mistral\)$",
        ),
    ],
    ids=["name", "path", "both", "not-a-model", "architecture"],
)
def test_a_bad_model_in_a_run_file_is_one_line_naming_it(tmp_path: Path, body: str, expected: str) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps({**QWEN3, "model_type": "gemma2"}))
    with pytest.raises(RunFileError, match=expected) as info:
        load(_run_file(tmp_path, body))
    assert "\n" not in str(info.value)


def test_a_directory_without_weights_or_tokenizer_is_refused(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    with pytest.raises(ModelNameError, match=r"has no tokenizer\.json"):
        check_model(str(model))
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelNameError, match=r"has no model\.safetensors"):
        check_model(str(model))


def test_the_flags_name_a_bad_model_in_one_line_and_start_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--model", "llama-7b", "--run-dir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr()
    assert out.err == (
        "slipstream demo: unknown model 'llama-7b': not a named model (known: smollm2-135m) and not a directory "
        f"({Path.cwd() / 'llama-7b'})\n"
    )
    assert not (tmp_path / "run").exists()
    path = _run_file(tmp_path, "")
    assert main(["train", str(path), "--model", str(tmp_path / "missing"), "--print-config"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"slipstream train: unknown model '{tmp_path / 'missing'}'")
    assert out.err.count("\n") == 1 and "Traceback" not in out.err


def test_train_model_flag_takes_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_dir(tmp_path / "q3")
    path = _run_file(tmp_path, "")
    assert main(["train", str(path), "--model", str(model), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f'model.path = "{model.resolve()}"' in out


def test_an_endpoint_table_opens_the_workers_endpoint(tmp_path: Path) -> None:
    from slipstream.run import run_env

    plan = load(_run_file(tmp_path, '[endpoint]\nport = 8123\nmodel_name = "m"\napi_keys = ["k1"]\n')).plan()
    assert plan.endpoint == {"enabled": True, "port": 8123, "model_name": "m", "api_keys": ["k1"]}
    env = run_env(plan)
    assert env["SLIPSTREAM_ENDPOINT__ENABLED"] == "true"
    assert env["SLIPSTREAM_ENDPOINT__PORT"] == "8123"
    assert env["SLIPSTREAM_ENDPOINT__API_KEYS"] == '["k1"]'
    assert not any(k.startswith("SLIPSTREAM_ENDPOINT__") for k in run_env(load(_run_file(tmp_path, "")).plan()))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[endpoint]\nprot = 1\n", r"run.toml:5: unknown key \[endpoint\] 'prot' \(known: enabled, host, port, "),
        (
            '[endpoint]\nrenderer = "chatml"\n',
            r"run.toml:5: \[endpoint\] no renderer for model family 'chatml'; known: ",
        ),
    ],
)
def test_a_bad_endpoint_key_or_renderer_is_named(tmp_path: Path, body: str, expected: str) -> None:
    with pytest.raises(RunFileError, match=expected):
        load(_run_file(tmp_path, body))
