"""Measure vLLM 0.33's KV cache grouping and sizing for the model configs in tests/data/model_configs.

Runs in the reference vLLM venv (never the project's), from a folder that is not a vLLM source
tree, and writes what vLLM's own planning functions answer as JSON:

    cd "$(mktemp -d)" && /root/vllm-ref/bin/python /path/to/kvservice/scripts/measure_vllm_kv_cache_layout.py \\
        /path/to/kvservice/tests/data/model_configs /path/to/kvservice/tests/data/vectors/vllm_kv_cache_layout.json

Per config: transformers' ``AutoConfig`` fills the architecture's defaults (``layer_types``,
``no_rope_layers``, ...); this script turns each decoder layer into the vLLM spec class vLLM's model
code picks for it (sliding window where ``layer_types`` or the model's rule says so, chunked local
for Llama 4's RoPE layers, MLA for DeepSeek), at block size 16 and bf16, and then calls vLLM's
``get_kv_cache_groups`` and ``get_kv_cache_config_from_groups`` (layout ``LBNHC``, what vLLM
resolves when no attention backend declares a layout, as on H100/H200) for two budgets. Only the
answers are written; nothing of vLLM goes into the project.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig
from vllm.config import CacheConfig
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
)

BLOCK_SIZE = 16
BUDGETS = {"1GiB": 1 << 30, "64GiB": 64 << 30}


def _layer_kinds(arch: str, tc) -> list[tuple[str, int | None]]:
    """(kind, window or chunk) per decoder layer, by vLLM 0.33's model code rules."""
    n = tc.num_hidden_layers
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return [("mla", None)] * n
    if arch == "GptOssForCausalLM":  # gpt_oss.py: even layers slide
        return [("sliding", tc.sliding_window) if i % 2 == 0 else ("full", None) for i in range(n)]
    if arch == "Llama4ForConditionalGeneration":  # llama4.py: RoPE layers are chunked local
        return [("chunked", tc.attention_chunk_size) if tc.no_rope_layers[i] else ("full", None) for i in range(n)]
    layer_types = getattr(tc, "layer_types", None)
    window = getattr(tc, "sliding_window", None)
    if layer_types is None or all(t == "sliding_attention" for t in layer_types):
        # vLLM's CacheConfig.sliding_window: every layer slides when the model is all sliding window.
        return [("sliding", window) if window else ("full", None)] * n
    return [("sliding", window) if t == "sliding_attention" else ("full", None) for t in layer_types]


def _specs(config_dir: Path) -> tuple[dict, dict]:
    cfg = AutoConfig.from_pretrained(config_dir)
    arch = cfg.architectures[0]
    tc = cfg.get_text_config()
    kinds = _layer_kinds(arch, tc)
    specs = {}
    for i, (kind, size) in enumerate(kinds):
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "mla":
            specs[name] = MLAAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=tc.kv_lora_rank + tc.qk_rope_head_dim,
                dtype=torch.bfloat16,
                cache_dtype_str="auto",
            )
            continue
        num_kv_heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        head_size = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        common = dict(block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16)
        if kind == "sliding":
            specs[name] = SlidingWindowSpec(**common, sliding_window=size)
        elif kind == "chunked":
            specs[name] = ChunkedLocalAttentionSpec(**common, attention_chunk_size=size)
        else:
            specs[name] = FullAttentionSpec(**common)
    return {"architecture": arch, "num_layers": len(kinds)}, specs


def _vllm_config() -> SimpleNamespace:
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    cache_config.kv_cache_layout = "LBNHC"
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        cache_config=cache_config,
        attention_config=SimpleNamespace(hisparse_config=None),
        model_config=SimpleNamespace(supports_kv_cache_grouping=False),
    )


def _group(group) -> dict:
    spec = group.kv_cache_spec
    inner = next(iter(spec.kv_cache_specs.values())) if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    return {
        "kind": get_kv_cache_spec_kind(spec).value,
        "sliding_window": getattr(inner, "sliding_window", None),
        "attention_chunk_size": getattr(inner, "attention_chunk_size", None),
        "num_layers": len(group.layer_names),
        "layer_names": list(group.layer_names),
        "block_size": spec.block_size,
        "page_size_bytes": inner.page_size_bytes,
    }


def main(config_root: str, out_path: str) -> None:
    logging.disable(logging.WARNING)
    vllm_config = _vllm_config()
    results = {}
    for config_dir in sorted(Path(config_root).iterdir()):
        facts, specs = _specs(config_dir)
        groups = get_kv_cache_groups(vllm_config, dict(specs))
        budgets = {}
        for label, budget in BUDGETS.items():
            kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, budget)
            budgets[label] = {
                "budget_bytes": budget,
                "num_blocks": kv_cache_config.num_blocks,
                "kv_cache_tensors": [
                    {
                        "size": t.size,
                        "num_layers": len(t.layers),
                        "layer_stride": t.layer_stride,
                        "block_stride": t.block_stride,
                        "offset": t.offset,
                    }
                    for t in kv_cache_config.kv_cache_tensors
                ],
            }
        results[config_dir.name] = {**facts, "groups": [_group(g) for g in groups], "budgets": budgets}
        print(
            config_dir.name,
            [(g["kind"], g["num_layers"]) for g in results[config_dir.name]["groups"]],
            {k: v["num_blocks"] for k, v in budgets.items()},
        )
    import vllm

    payload = {
        "source": f"vLLM {vllm.__version__}: get_kv_cache_groups + get_kv_cache_config_from_groups, layout LBNHC, "
        f"block size {BLOCK_SIZE}, bf16, TP 1 (scripts/measure_vllm_kv_cache_layout.py)",
        "models": results,
    }
    Path(out_path).write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
