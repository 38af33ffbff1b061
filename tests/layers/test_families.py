"""The family table: README's "Supported architectures" is the table in code; every family either
loads or is refused by name; field rules on configs transformers itself writes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from draft_circuit.circuit.layers.config import ConfigError
from draft_circuit.circuit.layers.families import (FAMILIES, FieldRule, UnsupportedArchitectureError,
                                                   UnsupportedConfigError, check_family, markdown_table)

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_section_is_the_table_in_code() -> None:
    text = README.read_text()
    section = text[text.index("## Supported architectures"):]
    section = section[:section.index("\n## ")]
    assert markdown_table() in section, "README's table is stale: paste families.markdown_table()"
    for f in FAMILIES:
        assert f"`{f.model_type}`" in section


def test_table_names_each_family_once() -> None:
    types = [f.model_type for f in FAMILIES if f.runs != "yes: `Eagle3Head`"]  # EAGLE-3: model_type llama
    archs = [a for f in FAMILIES for a in f.architectures]
    assert len(set(types)) == len(types) and len(set(archs)) == len(archs)
    assert {"llama", "deepseek_v3", "qwen2", "qwen3", "glm4_moe", "qwen3_next"} <= set(types)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model_type)
def test_every_family_loads_or_is_refused_with_its_reasons(family) -> None:
    by_type = next(f for f in FAMILIES if f.model_type == family.model_type)  # no architecture named
    for d in ({"model_type": family.model_type}, {"architectures": list(family.architectures)},
              {"model_type": family.model_type, "architectures": [family.architectures[0]]}):
        if family is not by_type and "architectures" not in d:
            assert check_family(d) is by_type  # an EAGLE-3 config always names its architecture
            continue
        if family.blocked:
            with pytest.raises(UnsupportedArchitectureError, match=re.escape(family.blocked[0][:40])):
                check_family(d, "x/config.json")
        else:
            assert check_family(d) is family
            assert family.refused  # a runnable family still says what it refuses


def test_field_rule_types_are_exact() -> None:
    rule = FieldRule("attention_bias", (False,), False, "why")
    assert not rule.violated({}) and not rule.violated({"attention_bias": None})
    assert not rule.violated({"attention_bias": False})
    assert rule.violated({"attention_bias": True}) and rule.violated({"attention_bias": 0})
    factor = FieldRule("a.b", (1.0,), 1.0, "why")
    assert not factor.violated({"a": {"b": 1}}) and factor.violated({"a": {"b": 0.5}})
    assert not factor.violated({"a": None})


def test_bad_architectures_field() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="'architectures' = 'LlamaForCausalLM'"):
        check_family({"architectures": "LlamaForCausalLM"})


# ---- configs as transformers writes them ----------------------------------------------------------

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def hf_config(name: str, **fields) -> dict:
    d = getattr(transformers, name)(**SMALL, **fields).to_dict()
    d["architectures"] = [name.replace("Config", "ForCausalLM")]
    return d


def test_transformers_llama_config_passes_and_its_bias_flags_are_refused() -> None:
    assert check_family(hf_config("LlamaConfig")).model_type == "llama"
    for field in ("attention_bias", "mlp_bias"):
        with pytest.raises(UnsupportedConfigError, match=rf"'{field}' = True \(LlamaForCausalLM"):
            check_family(hf_config("LlamaConfig", **{field: True}))
    with pytest.raises(UnsupportedConfigError, match="'hidden_act' = 'gelu'"):
        check_family(hf_config("LlamaConfig", hidden_act="gelu"))
    scaled = hf_config("LlamaConfig", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64})
    with pytest.raises(UnsupportedConfigError, match="'rope_parameters.rope_type' = 'llama3'"):
        check_family(scaled)


def test_transformers_qwen_configs_pass_and_set_their_attention() -> None:
    for name, options in (("Qwen2Config", {"qkv_bias": True}), ("Qwen3Config", {"qk_norm": True})):
        d = hf_config(name)
        assert check_family(d).config_options(d) == options
        with pytest.raises(UnsupportedConfigError, match=r"'use_sliding_window' = True"):
            check_family(hf_config(name, use_sliding_window=True))
    with pytest.raises(UnsupportedConfigError, match=r"'attention_bias' = True \(Qwen3ForCausalLM"):
        check_family(hf_config("Qwen3Config", attention_bias=True))


def test_transformers_glm4_moe_config_passes_and_sets_its_attention() -> None:
    d = hf_config("Glm4MoeConfig", attention_bias=True, use_qk_norm=True, head_dim=8)
    assert check_family(d).config_options(d) == {"qkv_bias": True, "qk_norm": True, "partial_rotary_factor": 0.5}
    d.pop("n_routed_experts")
    with pytest.raises(ConfigError, match=r"x/config\.json: config field 'n_routed_experts' is absent.*128"):
        check_family(d).config_options(d, "x/config.json")


def test_transformers_qwen3_next_config_passes_and_sets_its_attention() -> None:
    d = hf_config("Qwen3NextConfig", head_dim=8)
    family = check_family(d)
    assert family.model_type == "qwen3_next" and not family.blocked and family.target.startswith("no: its linear")
    assert family.config_options(d) == {"qk_norm": True, "partial_rotary_factor": 0.25}
    for field, value in (("attention_bias", True), ("decoder_sparse_step", 2), ("mlp_only_layers", [0])):
        with pytest.raises(UnsupportedConfigError, match=rf"'{field}' = {re.escape(repr(value))} \(Qwen3NextForCausalLM"):
            check_family(hf_config("Qwen3NextConfig", **{field: value}), "ckpt/config.json")
