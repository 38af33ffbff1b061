"""Checkpoint and config loading: round trips, alias rules, MTP layouts, fallbacks, and every error
class of FAULTS 21-22 with the file or tensor it must name."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers import checkpoint as ckpt
from draft_circuit.circuit.layers.checkpoint import (
    CorruptFileError, MissingConfigError, MissingMtpLayerError, MissingTensorError, TensorShapeError,
    UnexpectedTensorError, load_mtp_weights, load_target_weights, read_config,
)
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG, MTP_PARAM_SHAPES, TARGET_PARAM_SHAPES, ConfigError, MtpConfig

CFG = DEFAULT_CONFIG
L = CFG.num_hidden_layers
TIED = dataclasses.replace(CFG, tie_word_embeddings=True)


def stored(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read directly (the ground truth)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(os.fspath(f)))
    return out


def rewrite(file: Path, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None) -> None:
    tensors = {k: v for k, v in load_file(os.fspath(file)).items() if k not in drop}
    tensors.update(put or {})
    save_file(tensors, os.fspath(file))


def hf(**overrides) -> dict:
    d = CFG.to_hf()
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not ...}  # `...` deletes a field


# ---- config ---------------------------------------------------------------------------------

def test_to_hf_round_trips_through_json() -> None:
    d = json.loads(json.dumps(CFG.to_hf()))
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert d["num_nextn_predict_layers"] == 1
    assert MtpConfig.from_hf(d) == CFG


def test_defaults_for_kv_heads_and_head_dim() -> None:
    c = MtpConfig.from_hf(hf(num_key_value_heads=..., head_dim=...))
    assert c.num_key_value_heads == CFG.num_attention_heads
    assert c.head_dim == CFG.hidden_size // CFG.num_attention_heads


def test_heads_times_head_dim_may_differ_from_hidden() -> None:
    c = MtpConfig.from_hf(hf(head_dim=64))
    assert c.num_attention_heads * c.head_dim == 256 != c.hidden_size
    assert MTP_PARAM_SHAPES(c)["self_attn.o_proj.weight"] == (128, 256)


def test_rope_theta_from_rope_parameters_and_agreeing_aliases() -> None:
    params = {"rope_type": "default", "rope_theta": 500000.0}
    assert MtpConfig.from_hf(hf(rope_theta=..., rope_parameters=params)).rope_theta == 500000.0
    assert MtpConfig.from_hf(hf(rope_theta=500000, rope_parameters=params)).rope_theta == 500000.0
    assert MtpConfig.from_hf(hf(rope_theta=...)).rope_theta == 10000.0


def test_rope_aliases_that_disagree_raise_naming_both() -> None:
    d = hf(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with pytest.raises(ConfigError, match=r"rope_theta=10000\.0.*rope_parameters\.rope_theta=500000\.0"):
        MtpConfig.from_hf(d, source="ckpt/config.json")
    with pytest.raises(ConfigError, match="ckpt/config.json"):
        MtpConfig.from_hf(d, source="ckpt/config.json")


def test_moe_aliases_that_disagree_raise() -> None:
    MtpConfig.from_hf(hf(n_routed_experts=8, num_experts=8))
    with pytest.raises(ConfigError, match="n_routed_experts=8.*num_experts=16"):
        MtpConfig.from_hf(hf(n_routed_experts=8, num_experts=16))


def test_scaled_rope_is_refused() -> None:
    with pytest.raises(ConfigError, match="rope_scaling.rope_type.*llama3"):
        MtpConfig.from_hf(hf(rope_scaling={"rope_type": "llama3", "factor": 8.0}))


@pytest.mark.parametrize("overrides, field", [
    ({"vocab_size": ...}, "vocab_size"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"intermediate_size": 3.5}, "intermediate_size"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 33}, "head_dim"),
    ({"head_dim": ..., "num_attention_heads": 3}, "head_dim"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
])
def test_bad_fields_raise_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"'{field}'"):
        MtpConfig.from_hf(hf(**overrides))


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="'head_dim'"):
        dataclasses.replace(CFG, head_dim=31)


# ---- round trips and layouts ----------------------------------------------------------------

def test_mtp_round_trip_at_layer_L(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    config, w = load_mtp_weights(root)
    assert config == CFG
    files = stored(root)
    assert {k: tuple(v.shape) for k, v in w.items()} == MTP_PARAM_SHAPES(CFG)
    for name, t in w.items():
        assert torch.equal(t, files[f"model.layers.{L}.{name}"]), name


def test_target_round_trip(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    w = load_target_weights(root, CFG)
    files = stored(root)
    assert {k: tuple(v.shape) for k, v in w.items()} == TARGET_PARAM_SHAPES(CFG)
    assert all(torch.equal(t, files[k]) for k, t in w.items())


def test_writer_is_deterministic_and_scaled(tmp_path: Path) -> None:
    a, b = stored(write_random_checkpoint(tmp_path / "a")), stored(write_random_checkpoint(tmp_path / "b"))
    c = stored(write_random_checkpoint(tmp_path / "c", seed=1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])
    assert abs(a["model.norm.weight"].mean().item() - 1.0) < 0.05
    x = torch.randn(64, CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    y = x @ a["model.layers.0.mlp.gate_proj.weight"].T
    assert 0.7 < y.std().item() < 1.3  # fan-in scaling keeps activations O(1)


def test_mtp_at_layer0_exported_draft(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "d", mtp_at_layer0=True, include_target=False)
    _, w = load_mtp_weights(root)
    files = stored(root)
    assert all(torch.equal(t, files[f"model.layers.0.{n}"]) for n, t in w.items())
    with pytest.raises(MissingTensorError, match="is an MTP layer"):
        load_target_weights(root)


def test_exported_draft_layer0_is_never_read_as_the_target(tmp_path: Path) -> None:
    one_layer = dataclasses.replace(CFG, num_hidden_layers=1)
    root = write_random_checkpoint(tmp_path / "d", one_layer, mtp_at_layer0=True, include_target=False,
                                   mtp_shares_embed=True, mtp_shares_head=True)
    save_file({"model.norm.weight": torch.ones(128)}, os.fspath(root / "norm.safetensors"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.eh_proj\.weight.*MTP layer"):
        load_target_weights(root)


def test_layer_L_wins_over_layer0_marker(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    save_file({"model.layers.0.eh_proj.weight": torch.zeros(128, 256)}, os.fspath(root / "extra.safetensors"))
    _, w = load_mtp_weights(root)
    assert torch.equal(w["eh_proj.weight"], stored(root)[f"model.layers.{L}.eh_proj.weight"])


def test_dtype_is_applied(tmp_path: Path) -> None:
    _, w = load_mtp_weights(write_random_checkpoint(tmp_path / "c"), dtype=torch.bfloat16)
    assert {t.dtype for t in w.values()} == {torch.bfloat16}


# ---- fallbacks --------------------------------------------------------------------------------

def test_untied_fallbacks_to_target_embed_and_lm_head(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c", mtp_shares_embed=True, mtp_shares_head=True)
    files = stored(root)
    assert f"model.layers.{L}.embed_tokens.weight" not in files
    _, w = load_mtp_weights(root)
    assert torch.equal(w["embed_tokens.weight"], files["model.embed_tokens.weight"])
    assert torch.equal(w["shared_head.head.weight"], files["lm_head.weight"])


def test_tied_head_falls_back_to_embedding(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c", TIED, mtp_shares_embed=True, mtp_shares_head=True)
    files = stored(root)
    assert "lm_head.weight" not in files
    _, w = load_mtp_weights(root)
    assert torch.equal(w["shared_head.head.weight"], files["model.embed_tokens.weight"])
    t = load_target_weights(root)
    assert t["lm_head.weight"] is t["model.embed_tokens.weight"]


def test_tied_head_uses_the_layers_own_embedding(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "d", TIED, mtp_at_layer0=True, include_target=False, mtp_shares_head=True)
    _, w = load_mtp_weights(root)
    assert torch.equal(w["shared_head.head.weight"], stored(root)["model.layers.0.embed_tokens.weight"])


def test_untied_head_without_lm_head_names_the_keys(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "d", mtp_at_layer0=True, include_target=False, mtp_shares_head=True)
    rewrite(root / "model.safetensors", drop=("lm_head.weight",))
    with pytest.raises(MissingTensorError, match=r"shared_head\.head\.weight.*lm_head\.weight.*model\.safetensors"):
        load_mtp_weights(root)


# ---- errors (FAULT 21) ------------------------------------------------------------------------

def test_missing_mtp_layer_names_the_keys_looked_for(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c", dataclasses.replace(CFG, num_nextn_predict_layers=0))
    with pytest.raises(MissingMtpLayerError, match=rf"model\.layers\.{L}\.eh_proj\.weight.*model\.layers\.0\.eh_proj"):
        load_mtp_weights(root, CFG)
    with pytest.raises(MissingMtpLayerError, match="num_nextn_predict_layers=0"):
        load_mtp_weights(root)


def test_missing_tensor_names_tensor_and_files(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    rewrite(root / "model.safetensors", drop=(f"model.layers.{L}.hnorm.weight", "model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=rf"hnorm\.weight.*model\.layers\.{L}\.hnorm.*model\.safetensors"):
        load_mtp_weights(root)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_target_weights(root)


def test_wrong_shape_names_expected_and_actual(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    key = f"model.layers.{L}.self_attn.k_proj.weight"
    rewrite(root / "model.safetensors", put={key: torch.zeros(32, 128)})
    with pytest.raises(TensorShapeError, match=rf"model\.safetensors.*{key}.*\[32, 128\].*expected \[64, 128\]"):
        load_mtp_weights(root)


@pytest.mark.parametrize("shards", [1, 3])
def test_truncated_file_names_the_file(tmp_path: Path, shards: int) -> None:
    root = write_random_checkpoint(tmp_path / "c", shards=shards)
    victim = sorted(root.glob("*.safetensors"))[-1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(CorruptFileError, match=victim.name):
        load_mtp_weights(root)


def test_garbage_file_is_corrupt(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    (root / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CorruptFileError, match="junk.safetensors"):
        load_mtp_weights(root)


def test_missing_or_corrupt_config(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    (root / "config.json").unlink()
    with pytest.raises(MissingConfigError, match="config.json"):
        load_mtp_weights(root)
    assert load_mtp_weights(root, CFG)[0] == CFG  # an explicit config needs no config.json
    (root / "config.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="config.json"):
        read_config(root)
    (root / "config.json").write_text(json.dumps(hf(head_dim=33)))
    with pytest.raises(ConfigError, match=r"config\.json.*'head_dim'"):
        read_config(root)


def test_tensor_stored_twice_is_corrupt(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    save_file({"model.norm.weight": torch.ones(128)}, os.fspath(root / "dup.safetensors"))
    with pytest.raises(CorruptFileError, match=r"model\.norm\.weight.*stored twice"):
        load_target_weights(root)


# ---- strict vs lenient ------------------------------------------------------------------------

def test_extra_tensors_lenient_by_default_strict_raises(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")
    extra = f"model.layers.{L}.self_attn.rotary_emb.inv_freq"
    save_file({extra: torch.ones(16)}, os.fspath(root / "extra.safetensors"))
    _, w = load_mtp_weights(root)
    assert extra.removeprefix(f"model.layers.{L}.") not in w
    with pytest.raises(UnexpectedTensorError, match=rf"{extra}.*extra\.safetensors"):
        load_mtp_weights(root, strict=True)
    load_target_weights(root, strict=True)  # the MTP layer's prefix is not the target's business


def test_strict_ignores_tensors_outside_the_mtp_prefix(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c")  # the target's layers sit beside the MTP layer
    load_mtp_weights(root, strict=True)
    save_file({"model.vision_tower.weight": torch.ones(4)}, os.fspath(root / "extra.safetensors"))
    load_mtp_weights(root, strict=True)
    with pytest.raises(UnexpectedTensorError, match="vision_tower"):
        load_target_weights(root, strict=True)


# ---- sharded checkpoints ----------------------------------------------------------------------

def test_sharded_index_round_trip_and_only_named_files(tmp_path: Path) -> None:
    one = write_random_checkpoint(tmp_path / "one")
    three = write_random_checkpoint(tmp_path / "three", shards=3)
    assert len(list(three.glob("*.safetensors"))) == 3
    index = json.loads((three / ckpt.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(stored(one))
    (three / "stale.safetensors").write_bytes(b"garbage the index does not name")
    _, a = load_mtp_weights(one)
    _, b = load_mtp_weights(three)
    assert all(torch.equal(a[k], b[k]) for k in a)
    t1, t3 = load_target_weights(one), load_target_weights(three)
    assert all(torch.equal(t1[k], t3[k]) for k in t1)


def test_index_naming_a_missing_file(tmp_path: Path) -> None:
    root = write_random_checkpoint(tmp_path / "c", shards=2)
    victim = sorted(root.glob("*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CorruptFileError, match=rf"{ckpt.INDEX_NAME}.*{victim.name}"):
        load_mtp_weights(root)


def test_only_needed_tensors_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_random_checkpoint(tmp_path / "c", TIED, mtp_shares_head=True)
    reads: list[str] = []
    real_open = ckpt.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._h = real_open(*args, **kwargs)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def get_tensor(self, key):
            reads.append(key)
            return self._h.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self._h, name)

    monkeypatch.setattr(ckpt, "safe_open", Counting)
    load_mtp_weights(root)
    assert sorted(reads) == sorted(f"model.layers.{L}.{n}" for n in MTP_PARAM_SHAPES(CFG) if "head.weight" not in n)


# ---- writer arguments -------------------------------------------------------------------------

def test_writer_refuses_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="include_target"):
        write_random_checkpoint(tmp_path / "a", mtp_at_layer0=True)
    with pytest.raises(ValueError, match="shards"):
        write_random_checkpoint(tmp_path / "b", shards=0)
    write_random_checkpoint(tmp_path / "c")
    with pytest.raises(FileExistsError, match="already holds"):
        write_random_checkpoint(tmp_path / "c")
