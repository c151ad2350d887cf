"""One definition per setting: the CLI options, ``KVSERVICE_*`` names, TOML keys and
``ServerConfig(**flat)`` keywords all come from ``kvservice.server.settings``' table."""

from __future__ import annotations

import dataclasses
import logging

import click
import pytest
from click.testing import CliRunner

from kvservice.cli import main, serve
from kvservice.server.app import ServerConfig, load_config
from kvservice.server.event_log import EventLogConfig
from kvservice.server.nats_sink import NatsSinkConfig
from kvservice.server.settings import (
    SECTIONS,
    EventsSettings,
    NatsSettings,
    ZmqSettings,
    settings_table,
)

TABLE = settings_table()


def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def test_every_serve_option_is_a_setting_of_the_table_and_every_setting_an_option():
    options = {p.name: p for p in serve.params if isinstance(p, click.Option)}
    assert set(options) - set(TABLE) == {"config_file"}
    assert set(TABLE) - set(options) == set()
    for flat, row in TABLE.items():
        option = options[flat]
        assert option.opts == [row.option, *row.alias_options]
        assert option.default is None, f"{flat}: the default lives in its section only"
        assert option.help == row.help
    assert options["port"].help == "Port to bind; 0 picks a free one [50051]."
    assert options["kv_cache_memory"].help == "KV tensor budget in bytes, e.g. 512MiB [1GiB on CPU]."
    assert options["allow_insecure_bind"].secondary_opts == ["--no-allow-insecure-bind"]


def test_every_default_is_the_sections_and_the_configs():
    defaults = ServerConfig().flat()
    assert list(defaults) == list(TABLE)
    for flat, row in TABLE.items():
        section = next(s for s in SECTIONS if s.name == row.section)
        field = {f.name: f for f in dataclasses.fields(section)}[row.attr]
        assert defaults[flat] == row.default == field.default, flat
        assert getattr(getattr(ServerConfig(), row.section), row.attr) == row.default
    assert (
        defaults["port"],
        defaults["event_max_batches"],
        defaults["zmq_hwm"],
        defaults["nats_max_bytes"],
        defaults["max_message_bytes"],
        defaults["preset"],
    ) == (50051, 100_000, 100_000, 1 << 30, 64 << 20, "llama-3-8b")


@pytest.mark.parametrize("flat", list(TABLE))
def test_each_setting_by_env_toml_and_keyword_round_trips_its_default(flat, tmp_path):
    row = TABLE[flat]
    default = row.default
    env_value = "" if default is None else str(default)
    assert row.env == "KVSERVICE_" + flat.upper()
    assert load_config(None, {row.env: env_value}) == ServerConfig()
    assert ServerConfig(**{flat: default}) == ServerConfig()
    if default is not None:  # TOML has no null
        path = tmp_path / "c.toml"
        path.write_text(f"{flat.replace('_', '-')} = {_toml_value(default)}\n")
        assert load_config(path, {}) == ServerConfig()


def test_flat_names_build_and_replace_and_values_are_read_through_the_sections():
    config = ServerConfig(port=0, zmq_endpoint="tcp://127.0.0.1:*", event_max_batches=7)
    assert config.zmq == ZmqSettings(endpoint="tcp://127.0.0.1:*")
    assert (config.bind.port, config.events.max_batches, config.zmq.endpoint) == (0, 7, "tcp://127.0.0.1:*")
    assert dataclasses.replace(config, port=5).bind.port == 5 == config.replace(port=5).bind.port
    assert config.replace(port=5).events.max_batches == 7
    assert ServerConfig(events=EventsSettings(max_batches=3), max_streams=2).events == EventsSettings(
        max_batches=3, max_streams=2
    )
    with pytest.raises(TypeError, match="unknown setting 'colour'"):
        ServerConfig(colour=1)
    with pytest.raises(AttributeError):
        _ = config.colour
    with pytest.raises(AttributeError):  # a flat name is not read on the config: its section's field is, typed
        _ = config.port


def test_each_check_lives_in_one_section_and_names_the_flat_setting():
    assert EventLogConfig is EventsSettings
    with pytest.raises(ValueError, match="event_max_batches must be >= 1; got 0"):
        EventsSettings(max_batches=0)
    with pytest.raises(ValueError, match="nats_max_pending_batches must be >= 1; got 0"):
        ServerConfig(nats_max_pending_batches=0)
    with pytest.raises(
        ValueError, match=r"nats_url must name at least one server, e.g. nats://127.0.0.1:4222; got ', '"
    ):
        NatsSettings(url=",")
    with pytest.raises(ValueError, match=r"nats_duplicate_window_s \(200.0\) must be <= nats_max_age_s \(100.0\)"):
        NatsSettings(max_age_s=100.0, duplicate_window_s=200.0)
    sink = NatsSinkConfig.from_settings(
        NatsSettings(url="nats://a:1,nats://b:2", max_msgs=5), port=9, hostname="node.example"
    )
    assert (sink.servers, sink.instance, sink.subject, sink.max_msgs) == (
        ("nats://a:1", "nats://b:2"),
        "node_example-9",
        "kvservice.events.node_example-9",
        5,
    )


def test_an_unknown_kvservice_variable_warns_with_the_nearest_setting(caplog):
    with caplog.at_level(logging.WARNING, logger="kvservice.server.settings"):
        config = load_config(
            None, {"KVSERVICE_ZMQ_ENDPIONT": "tcp://*:1", "KVSERVICE_TOKEN": "t" * 32, "KVSERVICE_PORT": "1"}
        )
    assert config.bind.port == 1 and config.zmq.endpoint is None
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring KVSERVICE_ZMQ_ENDPIONT: no setting is called zmq_endpiont (did you mean KVSERVICE_ZMQ_ENDPOINT?)"
    ]


@pytest.mark.parametrize("args", [["--log-level", "DEBUG", "serve"], ["serve", "--log-level", "debug"]])
def test_log_level_works_before_and_after_the_subcommand(args, monkeypatch):
    import kvservice.server.app as app

    seen = []

    async def fake_run_server(config, **kwargs):
        seen.append(config)

    monkeypatch.setattr(app, "run_server", fake_run_server)
    result = CliRunner().invoke(main, args, env={"KVSERVICE_LOG_LEVEL": None})
    assert result.exit_code == 0, result.output
    assert seen[0].logging.log_level.upper() == "DEBUG"


@pytest.mark.parametrize("command", ["watch", "replay"])
def test_log_level_after_the_other_subcommands(command):
    import logging as logging_module

    result = CliRunner().invoke(main, [command, "--log-level", "INFO", "--help"])
    assert result.exit_code == 0 and "--log-level" in result.output
    root = logging_module.getLogger()
    saved = root.level
    try:
        from kvservice.cli import _log_level_option

        @click.command()
        @_log_level_option
        def probe() -> None:
            click.echo(logging_module.getLevelName(root.level))

        assert CliRunner().invoke(probe, ["--log-level", "error"]).output == "ERROR\n"
    finally:
        root.setLevel(saved)


def test_the_auth_tokens_file_help_names_every_role():
    from kvservice.server.auth import ROLES

    help_text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    line = help_text.split("--auth-tokens-file", 1)[1].split(" --", 1)[0]
    assert [role for role in ROLES if role not in line] == [], line


def test_the_tier_bounds_are_settings_with_the_cores_defaults_and_reach_its_limits():
    from kvservice.core.tier import TierLimits
    from kvservice.server.settings import TierSettings

    assert ServerConfig().tier.limits == TierLimits()
    config = load_config(
        None,
        {"KVSERVICE_TIER_MAX_LEASES": "3", "KVSERVICE_TIER_DEFAULT_LEASE_TTL_S": "2.5"},
        tier_max_keys_per_call="8",
        tier_max_lease_ttl_s="5",
    )
    assert config.tier == TierSettings(max_keys_per_call=8, default_lease_ttl_s=2.5, max_lease_ttl_s=5.0, max_leases=3)
    assert config.tier.limits == TierLimits(8, 2.5, 5.0, 3)
    assert [TABLE[f].option for f in TABLE if f.startswith("tier_")] == [
        "--tier-max-keys-per-call",
        "--tier-default-lease-ttl-s",
        "--tier-max-lease-ttl-s",
        "--tier-max-leases",
    ]


@pytest.mark.parametrize(
    "flat, value, message",
    [
        ("tier_max_keys_per_call", 0, "tier_max_keys_per_call must be >= 1 keys; got 0"),
        ("tier_max_leases", -1, "tier_max_leases must be >= 1 leases; got -1"),
        ("tier_max_lease_ttl_s", 0.0, "tier_max_lease_ttl_s must be a finite number > 0 seconds; got 0.0"),
        ("tier_max_lease_ttl_s", float("inf"), "tier_max_lease_ttl_s must be a finite number > 0 seconds; got inf"),
        ("tier_default_lease_ttl_s", float("nan"), "tier_default_lease_ttl_s must be a finite number > 0 seconds"),
        (
            "tier_default_lease_ttl_s",
            301.0,
            r"tier_default_lease_ttl_s (301.0) must be <= tier_max_lease_ttl_s (300.0) seconds",
        ),
    ],
)
def test_a_bad_tier_bound_is_refused_naming_the_setting_and_its_bound(flat, value, message):
    with pytest.raises(ValueError) as err:
        ServerConfig(**{flat: value})
    assert str(err.value).startswith(message), str(err.value)


def test_a_bad_tier_bound_on_the_command_line_or_in_the_environment_stops_serve_naming_it(monkeypatch):
    import kvservice.server.app as app

    async def never(config, **kwargs):  # pragma: no cover (the settings are refused first)
        raise AssertionError("started")

    monkeypatch.setattr(app, "run_server", never)
    result = CliRunner().invoke(main, ["serve", "--tier-max-leases", "0"])
    assert (result.exit_code, result.output) == (1, "Error: tier_max_leases must be >= 1 leases; got 0\n")
    result = CliRunner().invoke(main, ["serve"], env={"KVSERVICE_TIER_MAX_KEYS_PER_CALL": "many"})
    assert (result.exit_code, result.output) == (
        1,
        "Error: KVSERVICE_TIER_MAX_KEYS_PER_CALL: tier_max_keys_per_call: not an integer: 'many'\n",
    )
