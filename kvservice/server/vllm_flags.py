"""vLLM's spellings of kvservice settings, so a vLLM user's flags work unchanged.

Measured from vLLM 0.33 (``vllm.config.kv_events.KVEventsConfig`` and ``CacheConfig``; the
vectors are ``tests/data/vectors/vllm_flags.json``):

=====================================  ==========================================================
vLLM                                   kvservice
=====================================  ==========================================================
``--kv-events-config JSON``            ``zmq_*`` and ``event_max_batches`` (below)
``--prefix-caching-hash-algo``         ``hash_algorithm`` (sha256, sha256_cbor, xxhash, xxhash_cbor:
                                       all of vLLM's, with vLLM's digests)
``--num-gpu-blocks-override``          ``num_blocks`` (both count the null block)
``--kv-cache-dtype``                   ``kv_cache_dtype``: auto, float16, bfloat16, fp8 / fp8_e4m3
                                       (float8_e4m3fn), fp8_e5m2; vLLM's quantized formats
                                       (fp8_inc, nvfp4, ...) are refused, naming the ones served
``--max-model-len``, ``--block-size``,  the same names
``--gpu-memory-utilization``
=====================================  ==========================================================

``--kv-events-config`` keys (vLLM's ``KVEventsConfig``), each mapped only when given:

* ``enable_kv_cache_events`` (false) and ``publisher`` ("null" or "zmq"; unset: "zmq" when
  events are enabled, else "null"): as vLLM's ``EventPublisherFactory``, the ZMQ sink is on only
  when events are enabled and the publisher is "zmq", at ``endpoint`` (vLLM's default
  ``tcp://*:5557`` when not given; a bind off loopback still needs ``--allow-insecure-bind``: ZMQ
  has no authentication); otherwise it is off;
* ``endpoint`` -> ``zmq_endpoint``, ``replay_endpoint`` -> ``zmq_replay_endpoint``, ``topic`` ->
  ``zmq_topic``, ``hwm`` -> ``zmq_hwm``;
* ``buffer_steps`` (steps vLLM keeps for replay) -> ``event_max_batches`` (a step-batched
  scheduler appends one batch per step);
* ``max_queue_size`` (vLLM's queue between the engine and its publisher thread) is accepted and
  has no effect: kvservice publishes from the event loop without such a queue.

A setting given by name (flag, variable, file or keyword) wins over the JSON's value.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["KV_CACHE_DTYPES", "KV_EVENTS_CONFIG_KEYS", "kv_cache_torch_dtype", "kv_events_config_settings"]

KV_EVENTS_CONFIG_KEYS: dict[str, type | tuple[type, ...]] = {
    "enable_kv_cache_events": bool,
    "publisher": (str, type(None)),
    "endpoint": str,
    "replay_endpoint": (str, type(None)),
    "buffer_steps": int,
    "hwm": int,
    "max_queue_size": int,
    "topic": str,
}
"""vLLM 0.33's ``KVEventsConfig`` fields and the JSON types each takes."""

KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
"""vLLM's ``--kv-cache-dtype`` values served here, to the KV tensor dtype (None: the model's)."""


def kv_cache_torch_dtype(kv_cache_dtype: str) -> str | None:
    """The KV tensor dtype name of a ``--kv-cache-dtype`` (None for "auto": the preset's)."""
    return KV_CACHE_DTYPES[kv_cache_dtype]


def kv_events_config_settings(text: str) -> dict[str, Any]:
    """The kvservice settings (flat names) that vLLM's ``--kv-events-config`` JSON means.

    Raises:
        ValueError: not a JSON object, an unknown key, a value of the wrong type, or an unknown
            publisher (each message starts with ``kv_events_config`` and names the key).
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_events_config is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"kv_events_config must be a JSON object such as vLLM's; got {text!r}")
    for key, value in config.items():
        if key not in KV_EVENTS_CONFIG_KEYS:
            raise ValueError(
                f"kv_events_config: unknown key {key!r} (vLLM's KVEventsConfig has {', '.join(KV_EVENTS_CONFIG_KEYS)})"
            )
        expected = KV_EVENTS_CONFIG_KEYS[key]
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is int):
            raise ValueError(f"kv_events_config: {key} has the wrong type: {value!r}")
    publisher = config.get("publisher")
    if publisher is None:
        publisher = "zmq" if config.get("enable_kv_cache_events", False) else "null"
    if publisher not in ("null", "zmq"):
        raise ValueError(f"kv_events_config: publisher must be 'null' or 'zmq'; got {publisher!r}")
    settings: dict[str, Any] = {}
    if publisher == "null" or not config.get("enable_kv_cache_events", False):
        settings["zmq_endpoint"] = None
        settings["zmq_replay_endpoint"] = None
    else:
        settings["zmq_endpoint"] = config.get("endpoint", "tcp://*:5557")
        if "replay_endpoint" in config:
            settings["zmq_replay_endpoint"] = config["replay_endpoint"]
    for key, flat in (("topic", "zmq_topic"), ("hwm", "zmq_hwm"), ("buffer_steps", "event_max_batches")):
        if key in config:
            settings[flat] = config[key]
    return settings
