"""Server configuration: TOML file < KVSERVICE_* environment < explicit flags; bad values named."""

from __future__ import annotations

import pytest

from kvservice.server.app import ServerConfig, load_config, parse_bytes


def test_precedence_file_env_flags(tmp_path):
    path = tmp_path / "kvservice.toml"
    path.write_text('preset = "gemma-3-27b"\nport = 6000\nkv-cache-memory = "512MiB"\nhash_seed = "from-file"\n')
    env = {"KVSERVICE_PORT": "7000", "KVSERVICE_HASH_SEED": "from-env", "OTHER": "x"}
    config = load_config(path, env, port=8000, device=None)
    assert config == ServerConfig(preset="gemma-3-27b", port=8000, kv_cache_memory=512 * 2**20, hash_seed="from-env")
    assert load_config(path, env).bind.port == 7000
    assert load_config(path, {}).bind.port == 6000
    assert load_config(None, {}) == ServerConfig()


def test_a_kvservice_table_is_accepted(tmp_path):
    path = tmp_path / "kvservice.toml"
    path.write_text("[kvservice]\nnum_blocks = 64\n")
    assert load_config(path, {}).cache.num_blocks == 64


@pytest.mark.parametrize(
    "content, message",
    [
        ("colour = 1\n", "unknown key 'colour'"),
        ('preset = "gpt-5"\n', "preset must be one of"),
        ('hash_algorithm = "md5"\n', "hash_algorithm must be one of"),
        ('block_hash_format = "hex"\n', "block_hash_format must be 'int64' or 'digest'"),
        ("port = 70000\n", "port must be in 0..65535"),
        ("num_blocks = 0\n", "num_blocks must be >= 1"),
        ("gpu_memory_utilization = 1.5\n", r"gpu_memory_utilization must be in \(0, 1\]"),
        ('kv_cache_memory = "lots"\n', "not a byte count: 'lots'"),
        (f'kv_events_medium = "{"G" * 65}"\n', "kv_events_medium must be a non-empty string of at most 64 characters"),
    ],
)
def test_bad_settings_are_named(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_config(path, {})


def test_unknown_override_and_byte_units():
    with pytest.raises(ValueError, match="unknown setting 'colour'"):
        load_config(None, {}, colour=1)
    assert [parse_bytes(v) for v in ("1024", "1KiB", "1.5GiB", "2MB", "3g", 7)] == [
        1024,
        1024,
        3 * 2**29,
        2_000_000,
        3_000_000_000,
        7,
    ]


@pytest.mark.parametrize(
    "source, expected",
    [("true", True), ("TRUE", True), ("1", True), ("false", False), ("False", False), ("0", False)],
)
def test_bool_settings_from_the_environment(source, expected):
    assert load_config(None, {"KVSERVICE_ALLOW_INSECURE_BIND": source}).auth.allow_insecure_bind is expected


def test_bool_settings_from_toml_and_bad_values(tmp_path):
    path = tmp_path / "kvservice.toml"
    path.write_text("allow_insecure_bind = true\n")
    assert load_config(path, {}).auth.allow_insecure_bind is True
    assert load_config(path, {"KVSERVICE_ALLOW_INSECURE_BIND": "0"}).auth.allow_insecure_bind is False
    with pytest.raises(ValueError, match="KVSERVICE_ALLOW_INSECURE_BIND: allow_insecure_bind: not a boolean: 'maybe'"):
        load_config(None, {"KVSERVICE_ALLOW_INSECURE_BIND": "maybe"})


def test_auth_flags_reach_the_config(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import kvservice.server.app as app
    from kvservice.cli import main

    files = {name: tmp_path / name for name in ("cert.pem", "key.pem", "ca.pem", "tokens.toml")}
    for path in files.values():
        path.write_text("x")
    seen = []

    async def fake_run_server(config, **kwargs):
        seen.append(config)

    monkeypatch.setattr(app, "run_server", fake_run_server)
    args = [
        "serve",
        "--host",
        "0.0.0.0",
        "--tls-cert-file",
        str(files["cert.pem"]),
        "--tls-key-file",
        str(files["key.pem"]),
        "--tls-client-ca-file",
        str(files["ca.pem"]),
        "--auth-tokens-file",
        str(files["tokens.toml"]),
        "--allow-insecure-bind",
    ]
    result = CliRunner().invoke(main, args, env={"KVSERVICE_ALLOW_INSECURE_BIND": None})
    assert result.exit_code == 0, result.output
    config = seen[0]
    assert (
        config.bind.host,
        config.auth.tls_cert_file,
        config.auth.tls_key_file,
        config.auth.tls_client_ca_file,
        config.auth.auth_tokens_file,
        config.auth.allow_insecure_bind,
    ) == (
        "0.0.0.0",
        str(files["cert.pem"]),
        str(files["key.pem"]),
        str(files["ca.pem"]),
        str(files["tokens.toml"]),
        True,
    )
    result = CliRunner().invoke(main, ["serve"], env={"KVSERVICE_ALLOW_INSECURE_BIND": "1"})
    assert result.exit_code == 0 and seen[1].auth.allow_insecure_bind is True  # no flag: the environment's


def test_serve_refuses_an_open_bind_without_auth():
    from click.testing import CliRunner

    from kvservice.cli import main

    args = [
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--device",
        "meta",
        "--preset",
        "qwen-2.5-0.5b",
        "--block-size",
        "4",
        "--num-blocks",
        "16",
    ]
    result = CliRunner().invoke(main, args, env={"KVSERVICE_ALLOW_INSECURE_BIND": None})
    assert result.exit_code == 1
    assert "set allow_insecure_bind (--allow-insecure-bind) to bind anyway" in result.output


def test_relative_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "c.toml").write_text('auth_tokens_file = "tokens.toml"\ntls_cert_file = "/abs/server.pem"\n')
    monkeypatch.chdir(tmp_path)
    config = load_config(conf_dir / "c.toml", environ={"KVSERVICE_TLS_KEY_FILE": "rel.key"})
    assert config.auth.auth_tokens_file == str(conf_dir.resolve() / "tokens.toml")
    assert config.auth.tls_cert_file == "/abs/server.pem"
    assert config.auth.tls_key_file == "rel.key"  # the environment's paths stay relative to the working directory
