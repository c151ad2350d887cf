"""Model configs -> per-layer specs -> groups and num_blocks, compared with vLLM 0.33's own answers
(tests/data/vectors/vllm_kv_cache_layout.json, measured by scripts/measure_vllm_kv_cache_layout.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvservice.core.kv_cache_planning import get_kv_cache_tensors, get_num_blocks
from kvservice.core.kv_cache_spec import (
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvservice.core.model_config import (
    PRESETS,
    get_preset,
    load_kv_cache_layout,
    load_model_config,
    model_kv_layout,
    resolve_kv_cache_dtype,
)

DATA = Path(__file__).resolve().parents[1] / "data"
VECTORS = json.loads((DATA / "vectors" / "vllm_kv_cache_layout.json").read_text())["models"]
FAMILIES = sorted(VECTORS)


def _layer_indices(names) -> list[int]:
    return [int(re.search(r"layers\.(\d+)\.", name).group(1)) for name in names]


def test_every_family_has_a_config_and_a_vector() -> None:
    assert FAMILIES == sorted(p.name for p in (DATA / "model_configs").iterdir())
    assert {
        "llama-3.1-8b",
        "qwen2.5-7b",
        "qwen3-8b",
        "mistral-7b-v0.1",
        "gemma-2-9b",
        "gemma-3-27b",
        "gpt-oss-20b",
        "llama-4-scout",
        "deepseek-v2-lite",
        "deepseek-v3",
    } <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_groups_and_num_blocks_equal_vllm_033(family: str) -> None:
    expected = VECTORS[family]
    layout = model_kv_layout(load_model_config(DATA / "model_configs" / family), name=family)
    assert layout.architecture == expected["architecture"]
    assert len(layout.layer_specs) == expected["num_layers"]
    groups = layout.kv_cache_groups()
    got = []
    for group in groups:
        spec = group.kv_cache_spec
        got.append(
            {
                "kind": get_kv_cache_spec_kind(spec).value,
                "sliding_window": get_kv_cache_spec_sliding_window(spec),
                "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
                "num_layers": group.num_layers,
                "layers": _layer_indices(group.layer_names),
                "block_size": spec.block_size,
                "page_size_bytes": spec.page_size_bytes,
            }
        )
    want = [
        {**{k: g[k] for k in g if k != "layer_names"}, "layers": _layer_indices(g["layer_names"])}
        for g in expected["groups"]
    ]
    assert got == want
    for budget in expected["budgets"].values():
        num_blocks = get_num_blocks(groups, budget["budget_bytes"])
        assert num_blocks == budget["num_blocks"]
        tensors = get_kv_cache_tensors(groups, num_blocks)
        assert [
            {
                "size": t.size,
                "num_layers": t.num_layers,
                "layer_stride": t.layer_stride,
                "block_stride": t.block_stride,
                "offset": t.offset,
            }
            for t in tensors
        ] == budget["kv_cache_tensors"]


def test_gemma3_27b_at_64_gib_holds_vllms_block_count_6x_the_old_sizing() -> None:
    groups = get_preset("gemma-3-27b").kv_cache_groups()
    assert get_num_blocks(groups, 64 << 30) == VECTORS["gemma-3-27b"]["budgets"]["64GiB"]["num_blocks"] == 52428
    old_block_bytes = 62 * 2 * 16 * 16 * 128 * 2  # every group's pages per block id (main before)
    assert (64 << 30) // old_block_bytes == 8456


@pytest.mark.parametrize(
    ("preset", "family"),
    [
        ("llama-3-8b", "llama-3.1-8b"),
        ("qwen-2.5-0.5b", "qwen2.5-0.5b"),
        ("gemma-3-27b", "gemma-3-27b"),
        ("llama-4-scout", "llama-4-scout"),
        ("deepseek-v3", "deepseek-v3"),
    ],
)
def test_presets_are_the_real_configs(preset: str, family: str) -> None:
    from_config = model_kv_layout(load_model_config(DATA / "model_configs" / family / "config.json"))
    from_preset = PRESETS[preset].kv_layout()
    assert list(from_preset.layer_specs.values()) == list(from_config.layer_specs.values())
    assert from_preset.max_model_len == from_config.max_model_len


def test_architecture_defaults_fill_missing_fields() -> None:
    # Gemma-3's text_config leaves out max_position_embeddings and the 5:1 pattern.
    layout = get_preset("gemma-3-27b").kv_layout()
    assert layout.max_model_len == 131072
    windows = [getattr(s, "sliding_window", None) for s in layout.layer_specs.values()]
    assert windows[:6] == [1024] * 5 + [None] and windows.count(None) == 10
    # Llama's num_key_value_heads defaults to num_attention_heads, head_dim to hidden // heads.
    spec = model_kv_layout(
        {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8}
    ).layer_specs["model.layers.0.self_attn.attn"]
    assert (spec.num_kv_heads, spec.head_size, spec.dtype, spec.block_size) == (8, 128, "bfloat16", 16)
    # gpt-oss: even layers slide 128 tokens.
    gpt = model_kv_layout(load_model_config(DATA / "model_configs" / "gpt-oss-20b"))
    assert [isinstance(s, SlidingWindowSpec) for s in gpt.layer_specs.values()][:4] == [True, False, True, False]
    ds = get_preset("deepseek-v3").kv_layout()
    assert all(isinstance(s, MLAAttentionSpec) and s.head_size == 576 for s in ds.layer_specs.values())


def test_kv_cache_dtype_and_block_size() -> None:
    assert resolve_kv_cache_dtype("auto", {"torch_dtype": "float32"}) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", {}) == "bfloat16"
    assert resolve_kv_cache_dtype("auto", {"torch_dtype": "float16"}, "LlamaForCausalLM") == "float16"
    assert resolve_kv_cache_dtype("auto", {"torch_dtype": "float16"}, "Gemma2ForCausalLM") == "bfloat16"
    assert resolve_kv_cache_dtype("fp8", {}) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        resolve_kv_cache_dtype("int3", {})
    layout = get_preset("llama-3-8b").kv_layout(block_size=32, kv_cache_dtype="fp8")
    spec = next(iter(layout.layer_specs.values()))
    assert (spec.block_size, spec.dtype, spec.page_size_bytes) == (32, "float8_e4m3fn", 2 * 32 * 8 * 128)


BASE = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({k: v for k, v in BASE.items() if k != "num_hidden_layers"}, "missing field 'num_hidden_layers'"),
        ({**BASE, "num_attention_heads": 0}, "num_attention_heads must be an integer >= 1; got 0"),
        ({**BASE, "num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1; got 0"),
        ({**BASE, "architectures": ["BertModel"]}, "unknown architecture 'BertModel'; known: LlamaForCausalLM"),
        ({k: v for k, v in BASE.items() if k != "architectures"}, "missing field 'architectures'"),
        (
            {**BASE, "sliding_window": 8192, "max_position_embeddings": 4096},
            "sliding_window of 8192 tokens exceeds max_model_len",
        ),
        (
            {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2, "qk_rope_head_dim": 64},
            "missing field 'kv_lora_rank'",
        ),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"num_hidden_layers": 6}},
            "missing field 'text_config.num_attention_heads'",
        ),
    ],
)
def test_bad_configs_name_the_field(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        model_kv_layout(config, name="m.json")


def test_model_config_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_model_config(tmp_path)


LAYOUT = """
max_model_len = 32768
[[layers]]
kind = "sliding_window"
count = 5
num_kv_heads = 16
head_size = 128
sliding_window = 1024
[[layers]]
kind = "full_attention"
num_kv_heads = 16
head_size = 128
"""


def test_layout_file_groups_as_a_config_does(tmp_path: Path) -> None:
    path = tmp_path / "gemma-like.toml"
    path.write_text(LAYOUT * 1 + "".join(LAYOUT.split("max_model_len = 32768")[1:]) * 9)
    layout = load_kv_cache_layout(path)
    assert (layout.name, layout.max_model_len, len(layout.layer_specs)) == ("gemma-like", 32768, 60)
    groups = layout.kv_cache_groups()
    assert [(get_kv_cache_spec_kind(g.kv_cache_spec).value, g.num_layers) for g in groups] == [
        ("sliding_window", 10)
    ] * 5 + [("full_attention", 10)]
    assert groups[0].layer_names[:2] == ("layers.0", "layers.6")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[layers]]\nkind='full_attention'\nnum_kv_heads=1\nhead_size=8\n", "missing field 'max_model_len'"),
        ("max_model_len=10\n", "missing field 'layers'"),
        ("max_model_len=10\n[[layers]]\nkind='lstm'\n", "layers[0].kind must be one of full_attention"),
        (
            "max_model_len=10\n[[layers]]\nkind='full_attention'\nhead_size=8\n",
            "missing field 'layers[0].num_kv_heads'",
        ),
        (
            "max_model_len=10\n[[layers]]\nkind='full_attention'\nnum_kv_heads=0\nhead_size=8\n",
            "layers[0].num_kv_heads must be an integer >= 1; got 0",
        ),
        (
            "max_model_len=10\n[[layers]]\nkind='sliding_window'\nnum_kv_heads=1\nhead_size=8\nsliding_window=11\n",
            "layers[0].sliding_window of 11 tokens exceeds max_model_len (10 tokens)",
        ),
        (
            "max_model_len=10\n[[layers]]\nkind='full_attention'\nnum_kv_heads=1\nhead_size=8\nwindow=3\n",
            "unknown keys ['window'] for kind 'full_attention'",
        ),
    ],
)
def test_bad_layout_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_kv_cache_layout(path)


@pytest.mark.parametrize("value", ["opaque:", "opaque:0", "opaque:4096x", "opaque:4096x0", "opaque:x2", "opaque:4k"])
def test_an_opaque_layout_that_is_not_bytes_and_groups_is_refused_naming_the_form(value):
    from kvservice.core.model_config import opaque_kv_layout

    with pytest.raises(ValueError) as caught:
        opaque_kv_layout(value)
    assert str(caught.value) == (
        f"kv_cache_layout {value!r}: the opaque layout is opaque:BYTES or opaque:BYTESxGROUPS "
        "(bytes per block >= 1, groups >= 1)"
    )
