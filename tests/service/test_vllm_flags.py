"""vLLM's flags work on ``kvservice serve``: --kv-events-config (checked against what vLLM 0.33
was measured to do, tests/data/vectors/vllm_flags.json), --prefix-caching-hash-algo,
--num-gpu-blocks-override, --kv-cache-dtype, --max-model-len, --block-size,
--gpu-memory-utilization."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvservice.cli import main
from kvservice.server.app import ServerConfig, load_config
from kvservice.server.vllm_flags import KV_CACHE_DTYPES, KV_EVENTS_CONFIG_KEYS, kv_events_config_settings
from kvservice_client.hashing import HASH_ALGORITHMS
from tests.conftest import VECTORS_DIR

VECTORS = json.loads((VECTORS_DIR / "vllm_flags.json").read_text())


def serve_config(args, monkeypatch):
    """The ServerConfig ``kvservice serve ARGS`` would run (run_server replaced)."""
    import kvservice.server.app as app

    seen = []

    async def fake_run_server(config, **kwargs):
        seen.append(config)

    monkeypatch.setattr(app, "run_server", fake_run_server)
    result = CliRunner().invoke(main, ["serve", *args], env={"KVSERVICE_ALLOW_INSECURE_BIND": None})
    assert result.exit_code == 0, result.output
    return seen[0]


def test_kv_events_config_keys_are_vllms():
    assert list(KV_EVENTS_CONFIG_KEYS) == list(VECTORS["kv_events_config_defaults"])


@pytest.mark.parametrize("case", VECTORS["kv_events_config_publisher_rule"], ids=lambda c: json.dumps(c["given"]))
def test_the_zmq_sink_is_on_exactly_when_vllm_would_publish(case):
    settings = kv_events_config_settings(json.dumps(case["given"]))
    assert (settings["zmq_endpoint"] is not None) is case["publishes"]
    if case["publishes"]:
        assert settings["zmq_endpoint"] == case["endpoint"] == "tcp://*:5557"


def test_vllms_example_invocations_map_onto_the_zmq_settings(monkeypatch):
    first, second = (example["args"] for example in VECTORS["example_invocations"])
    config = serve_config([*first, "--allow-insecure-bind"], monkeypatch)
    assert (config.zmq.endpoint, config.zmq.replay_endpoint, config.zmq.topic) == (
        "tcp://*:5557",
        "tcp://*:5558",
        "kv-events",
    )
    assert config.zmq.kv_events_config == json.loads(json.dumps(first[1])) and config.events.max_batches == 100_000
    config = serve_config([*second, "--allow-insecure-bind"], monkeypatch)
    assert (config.zmq.endpoint, config.zmq.replay_endpoint, config.zmq.topic) == ("tcp://*:20080", None, "")


def test_kv_events_config_keeps_kvservices_bind_rule_and_a_named_setting_wins():
    example = '{"enable_kv_cache_events": true, "topic": "t", "hwm": 10, "buffer_steps": 64, "max_queue_size": 5}'
    with pytest.raises(ValueError, match=r"zmq_endpoint 'tcp://\*:5557' binds a non-loopback address"):
        load_config(None, {}, kv_events_config=example)
    config = load_config(
        None, {"KVSERVICE_ZMQ_TOPIC": "from-env"}, kv_events_config=example, zmq_endpoint="tcp://127.0.0.1:*"
    )
    assert (config.zmq.endpoint, config.zmq.topic, config.zmq.hwm, config.events.max_batches) == (
        "tcp://127.0.0.1:*",
        "from-env",
        10,
        64,
    )
    assert ServerConfig(kv_events_config='{"enable_kv_cache_events": false}').zmq.endpoint is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "kv_events_config is not JSON"),
        ("[1]", "kv_events_config must be a JSON object"),
        ('{"colour": 1}', "kv_events_config: unknown key 'colour' \\(vLLM's KVEventsConfig has enable_kv_cache_events"),
        ('{"hwm": "x"}', "kv_events_config: hwm has the wrong type: 'x'"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be 'null' or 'zmq'; got 'kafka'"),
    ],
)
def test_a_bad_kv_events_config_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(kv_events_config=text)


def test_vllms_cache_flags_spelled_as_vllm_spells_them(monkeypatch):
    config = serve_config(
        [
            "--prefix-caching-hash-algo",
            "sha256",
            "--num-gpu-blocks-override",
            "64",
            "--kv-cache-dtype",
            "fp8",
            "--max-model-len",
            "128",
            "--block-size",
            "16",
            "--gpu-memory-utilization",
            "0.5",
        ],
        monkeypatch,
    )
    assert (
        config.cache.hash_algorithm,
        config.cache.num_blocks,
        config.cache.kv_cache_dtype,
        config.cache.max_model_len,
        config.cache.block_size,
        config.cache.gpu_memory_utilization,
    ) == ("sha256", 64, "fp8", 128, 16, 0.5)


def test_vllm_values_not_served_here_are_refused_naming_those_that_are():
    # Every hash algorithm vLLM 0.33 offers is served, with vLLM's digests (tests/unit/test_vllm_vectors.py).
    assert set(HASH_ALGORITHMS) == set(VECTORS["prefix_caching_hash_algo_choices"])
    assert ServerConfig(prefix_caching_hash_algo="xxhash_cbor").cache.hash_algorithm == "xxhash_cbor"
    assert set(KV_CACHE_DTYPES) < set(VECTORS["cache_dtype_choices"])
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2; got 'nvfp4'"
    ):
        load_config(None, {"KVSERVICE_KV_CACHE_DTYPE": "nvfp4"})


async def test_kv_cache_dtype_sets_the_kv_tensors_dtype(start_kv_server, connect):
    bf16 = await (await connect(await start_kv_server())).get_kv_cache_group_metadata()
    fp8 = await (await connect(await start_kv_server(kv_cache_dtype="fp8"))).get_kv_cache_group_metadata()
    assert (bf16.groups[0].dtype, fp8.groups[0].dtype) == ("bfloat16", "float8_e4m3fn")
    assert fp8.groups[0].bytes_per_block * 2 == bf16.groups[0].bytes_per_block
