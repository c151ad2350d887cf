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
    assert load_config(path, env).port == 7000
    assert load_config(path, {}).port == 6000
    assert load_config(None, {}) == ServerConfig()


def test_a_kvservice_table_is_accepted(tmp_path):
    path = tmp_path / "kvservice.toml"
    path.write_text("[kvservice]\nnum_blocks = 64\n")
    assert load_config(path, {}).num_blocks == 64


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
        1024, 1024, 3 * 2**29, 2_000_000, 3_000_000_000, 7]
