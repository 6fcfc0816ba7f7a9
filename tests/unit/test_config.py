"""The config loader: precedence, unknown keys, type errors, --print-config and --help."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, ClassVar

import msgspec
import pytest

from slipstream.runtime.base import ServiceConfig
from slipstream.runtime.config import ConfigError, dump, env_name, parse_args, parse_cli, resolve
from slipstream.runtime.section import ServiceSection
from slipstream.telemetry.config import TelemetryConfig

pytestmark = pytest.mark.unit
Doc = msgspec.Meta


class Alpha(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Doc(description="Alpha's display name.")] = "default"
    count: Annotated[int, Doc(description="How many alphas to keep.")] = 1
    ratio: Annotated[float, Doc(description="Share of alphas kept warm.")] = 0.5
    tags: Annotated[list[str], Doc(description="Labels attached to alphas.")] = msgspec.field(default_factory=list)
    enabled: Annotated[bool, Doc(description="Whether alphas run at all.")] = False


class Cfg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    service: ServiceSection = msgspec.field(default_factory=ServiceSection)
    alpha: Alpha = msgspec.field(default_factory=Alpha)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_defaults_when_no_layer_sets_anything() -> None:
    cfg = resolve(Cfg, environ={})
    assert cfg == Cfg()
    assert (cfg.alpha.count, cfg.alpha.name, cfg.service.drain_timeout_s) == (1, "default", 20.0)


def test_each_layer_overrides_the_previous_one(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, '[alpha]\nname = "toml"\ncount = 2\nratio = 0.7\n[service]\nhttp_port = 9000\n')
    env = {"SLIPSTREAM_ALPHA__NAME": "env", "SLIPSTREAM_ALPHA__COUNT": "3"}
    args = parse_args(Cfg, ["--config", str(toml), "--alpha.count", "4"])
    cfg = resolve(Cfg, args, environ=env)
    assert cfg.alpha.count == 4  # CLI beats env, TOML, default
    assert cfg.alpha.name == "env"  # env beats TOML
    assert cfg.alpha.ratio == 0.7  # TOML beats default
    assert cfg.service.http_port == 9000
    assert cfg.alpha.tags == [] and cfg.alpha.enabled is False  # untouched defaults
    # Without the CLI flag the env value shows through; without env, the TOML one.
    assert resolve(Cfg, parse_args(Cfg, ["--config", str(toml)]), environ=env).alpha.count == 3
    assert resolve(Cfg, parse_args(Cfg, ["--config", str(toml)]), environ={}).alpha.count == 2


def test_json_values_for_lists_and_bools_in_every_layer(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, '[alpha]\ntags = ["t1", "t2"]\n')
    assert resolve(Cfg, config_file=toml, environ={}).alpha.tags == ["t1", "t2"]
    env = {"SLIPSTREAM_ALPHA__TAGS": '["e1"]', "SLIPSTREAM_ALPHA__ENABLED": "true"}
    cfg = resolve(Cfg, config_file=toml, environ=env)
    assert (cfg.alpha.tags, cfg.alpha.enabled) == (["e1"], True)
    args = parse_args(Cfg, ["--alpha.tags", '["c1", "c2", "c3"]'])
    assert resolve(Cfg, args, environ=env).alpha.tags == ["c1", "c2", "c3"]
    with pytest.raises(ConfigError, match="looks like JSON"):
        resolve(Cfg, parse_args(Cfg, ["--alpha.tags", '["c1"']), environ={})


def test_an_empty_value_is_the_empty_string_not_json() -> None:
    assert resolve(Cfg, environ={"SLIPSTREAM_ALPHA__NAME": ""}).alpha.name == ""
    assert resolve(Cfg, parse_args(Cfg, ["--alpha.name", ""]), environ={}).alpha.name == ""


def test_flags_accept_dashes_underscores_and_equals() -> None:
    args = parse_args(Cfg, ["--service.drain_timeout_s=2.5", "--service.http-port", "81"])
    cfg = resolve(Cfg, args, environ={})
    assert (cfg.service.drain_timeout_s, cfg.service.http_port) == (2.5, 81)


def test_unknown_section_in_toml_is_named(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, "[beta]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section 'beta'"):
        resolve(Cfg, config_file=toml, environ={})


def test_unknown_key_in_toml_is_named(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, "[alpha]\ncolour = 'red'\n")
    with pytest.raises(ConfigError, match=r"unknown key alpha\.colour") as exc:
        resolve(Cfg, config_file=toml, environ={})
    assert str(toml) in str(exc.value)


def test_unknown_key_in_env_is_named_but_foreign_sections_are_skipped() -> None:
    with pytest.raises(ConfigError, match=r"SLIPSTREAM_ALPHA__COLOUR names unknown key alpha\.colour"):
        resolve(Cfg, environ={"SLIPSTREAM_ALPHA__COLOUR": "red"})
    # A shared env file may carry another service's section: not this service's error.
    assert resolve(Cfg, environ={"SLIPSTREAM_LEARNER__LR": "0.1", "SLIPSTREAM_TEST_SEED": "7"}) == Cfg()


def test_unknown_key_and_section_on_the_command_line_are_named() -> None:
    with pytest.raises(ConfigError, match=r"--alpha\.colour names unknown key alpha\.colour"):
        parse_args(Cfg, ["--alpha.colour", "red"])
    with pytest.raises(ConfigError, match=r"unknown section 'beta'"):
        parse_args(Cfg, ["--beta.x", "1"])
    # No prefix matching: a typo is an error, not a silent abbreviation of --alpha.count.
    with pytest.raises(ConfigError, match=r"unknown key alpha\.coun\b"):
        parse_args(Cfg, ["--alpha.coun", "3"])


def test_parse_cli_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_cli(Cfg, ["--alpha.colour", "red"], prog="svc")
    assert exc.value.code == 2
    assert "unknown key alpha.colour" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("layer", "expected"),
    [("toml", "config file"), ("env", "environment"), ("cli", "command line")],
)
def test_bad_types_name_the_field_and_the_layer(tmp_path: Path, layer: str, expected: str) -> None:
    toml = write_toml(tmp_path, '[alpha]\ncount = "many"\n' if layer == "toml" else "")
    env = {"SLIPSTREAM_ALPHA__COUNT": "many"} if layer == "env" else {}
    argv = ["--config", str(toml)] + (["--alpha.count", "many"] if layer == "cli" else [])
    with pytest.raises(ConfigError) as exc:
        resolve(Cfg, parse_args(Cfg, argv), environ=env)
    msg = str(exc.value)
    assert "Expected `int`, got `str`" in msg
    assert "$.alpha.count" in msg
    assert f"alpha.count set by {expected}" in msg


def test_constraints_and_cross_field_checks_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"\$\.service\.http_port"):
        resolve(Cfg, environ={"SLIPSTREAM_SERVICE__HTTP_PORT": "70000"})
    with pytest.raises(ConfigError, match="traces_file"):
        resolve(Cfg, environ={"SLIPSTREAM_TELEMETRY__TRACES": "file"})
    with pytest.raises(ConfigError, match=r"\$\.telemetry\.log_level"):
        resolve(Cfg, environ={"SLIPSTREAM_TELEMETRY__LOG_LEVEL": "loud"})


def test_missing_or_broken_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(Cfg, config_file=tmp_path / "nope.toml", environ={})
    broken = write_toml(tmp_path, "[alpha\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(Cfg, config_file=broken, environ={})


def test_print_config_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = write_toml(tmp_path, '[alpha]\nname = "from-toml"\nratio = 0.25\n')
    monkeypatch.setenv("SLIPSTREAM_ALPHA__COUNT", "7")
    argv = ["--config", str(toml), "--alpha.tags", '["a", "b"]', "--service.run-id", "run-9"]
    expected = parse_cli(Cfg, argv)
    with pytest.raises(SystemExit) as exc:
        parse_cli(Cfg, [*argv, "--print-config"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    printed = msgspec.json.decode(out, type=Cfg)
    assert printed == expected
    assert (printed.alpha.name, printed.alpha.count, printed.alpha.tags) == ("from-toml", 7, ["a", "b"])
    assert json.loads(out)["service"]["run_id"] == "run-9"


def test_help_documents_every_field_with_its_env_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_cli(Cfg, ["--help"], prog="svc")
    assert exc.value.code == 0
    # argparse wraps lines; compare with whitespace collapsed.
    text = " ".join(capsys.readouterr().out.split())
    for sec, section in (("service", ServiceSection), ("alpha", Alpha), ("telemetry", TelemetryConfig)):
        schema = msgspec.json.schema(section)
        props = schema["$defs"][section.__name__]["properties"]
        for field in msgspec.structs.fields(section):
            assert f"--{sec}.{field.name.replace('_', '-')}" in text
            assert env_name(sec, field.name) in text
            assert " ".join(props[field.name]["description"].split()) in text, field.name


class Svc(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    section_docs: ClassVar[dict[str, str]] = {"store": "Where this service keeps its checkpoints."}
    alpha: Alpha = msgspec.field(default_factory=Alpha)


def test_a_service_config_is_the_shared_sections_then_its_own() -> None:
    assert [f.name for f in msgspec.structs.fields(Svc)] == ["service", "bus", "store", "telemetry", "alpha"]
    cfg = resolve(
        Svc,
        environ={
            "SLIPSTREAM_STORE__ROOT": "/tmp/s",
            "SLIPSTREAM_BUS__URL": "nats://h:1",
            "SLIPSTREAM_ALPHA__COUNT": "3",
        },
    )
    assert (cfg.store.root, cfg.bus.url, cfg.alpha.count) == ("/tmp/s", "nats://h:1", 3)
    assert list(json.loads(dump(cfg))) == ["service", "bus", "store", "telemetry", "alpha"]
    with pytest.raises(ConfigError, match=r"unknown key store\.rooot"):
        resolve(Svc, environ={"SLIPSTREAM_STORE__ROOOT": "x"})


def test_section_docs_replace_a_shared_sections_line_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_cli(Svc, ["--help"], prog="svc")
    text = " ".join(capsys.readouterr().out.split())
    assert "[store]: Where this service keeps its checkpoints." in text
    assert "[bus]: Message bus (NATS JetStream or in-memory)." in text
    assert "Object store (local directory or S3)." not in text
    assert ServiceConfig.section_docs == {}
