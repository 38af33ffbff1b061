"""EAGLE-3 checkpoints in the published layout: what loads (the chain over loaded tensors equals the
reference), the family that names it, and every refusal by name: no d2t under a reduced vocabulary,
lm_head rows that disagree with draft_vocab_size, bad d2t / t2d, biases, a missing embedding."""
from __future__ import annotations

import json

import pytest
import torch

from draft_circuit.circuit.layers.checkpoint_errors import (CorruptFileError, MissingTensorError,
                                                            TensorDtypeError, TensorShapeError,
                                                            UnexpectedTensorError, UnsupportedTensorError)
from draft_circuit.circuit.layers.eagle3 import Eagle3Config, Eagle3Head, eagle3_checkpoint_shapes
from draft_circuit.circuit.layers.eagle3_checkpoint import (load_eagle3_weights, read_eagle3_config,
                                                            write_random_eagle3_checkpoint)
from draft_circuit.circuit.layers.families import (UnsupportedArchitectureError, UnsupportedConfigError,
                                                   check_family)
from draft_circuit.circuit.layers.heads import describe_head, load_head
from draft_circuit.circuit.layers.mtp import emit_draft_chain
from draft_circuit.runners.eager import EagerRunner

from tests.layers.eagle3_reference import CFG, KV, K, eager_inputs, paged_rows, reference_chain


def test_loaded_checkpoint_drafts_what_the_reference_drafts(tmp_path):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, seed=4)
    head, weights = load_head(root)
    assert isinstance(head, Eagle3Head) and head.config == CFG
    assert set(weights) == {*eagle3_checkpoint_shapes(CFG), "d2t"}
    assert describe_head(head).startswith("Eagle3Head: fc over 3 x 24 tapped hiddens, draft vocabulary 70 of 160")
    chain = emit_draft_chain(head, K, max_width=4, kv=KV)
    batch = eager_inputs(3, seed=2)
    out = EagerRunner(chain, head.bind(weights), batch.clone_states()).run(batch.inputs)
    for i in range(3):
        keys, vals = paged_rows(batch, i, batch.lives[i])
        drafts, _, _ = reference_chain(weights, CFG, K, int(batch.inputs["tokens"][i]), batch.inputs["hidden"][i],
                                       int(batch.inputs["positions"][i]), keys, vals)
        assert out["drafts"][i].tolist() == drafts


def test_the_family_table_names_both_published_architectures():
    for arch in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"):
        family = check_family({"architectures": [arch], "model_type": "llama"})
        assert family.runs == "yes: `Eagle3Head`"
    assert check_family({"model_type": "llama"}).architectures == ("LlamaForCausalLM",)
    with pytest.raises(UnsupportedArchitectureError, match="disagree"):
        check_family({"architectures": ["LlamaForCausalLMEagle3", "LlamaForCausalLM"]})
    with pytest.raises(UnsupportedArchitectureError, match="disagree"):
        check_family({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "qwen2"})


@pytest.mark.parametrize("override, match", [
    ({"attention_bias": True}, "'attention_bias' = True"),
    ({"bias": True}, "'bias' = True"),
    ({"tie_word_embeddings": True}, "'tie_word_embeddings' = True"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "'eagle_config.use_aux_hidden_state' = False"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling.rope_type' = 'llama3'"),
])
def test_configs_that_change_the_math_are_refused(tmp_path, override, match):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, config_overrides=override)
    with pytest.raises(UnsupportedConfigError, match=match):
        read_eagle3_config(root)


def test_a_checkpoint_missing_d2t_is_refused_by_name(tmp_path):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, include_d2t=False, include_t2d=False)
    with pytest.raises(MissingTensorError, match="'d2t'.*draft_vocab_size = 70 < vocab_size = 160"):
        load_eagle3_weights(root)


def test_full_vocabulary_without_d2t_keeps_the_target_ids(tmp_path):
    full = Eagle3Config(**{**CFG.__dict__, "draft_vocab_size": CFG.vocab_size})
    root = write_random_eagle3_checkpoint(tmp_path / "e3", full, include_d2t=False, include_t2d=False)
    _, weights = load_eagle3_weights(root)
    assert torch.equal(Eagle3Head(full).bind(weights)["draft_vocab.ids"], torch.arange(160, dtype=torch.int32))


def test_lm_head_rows_that_disagree_with_draft_vocab_size_are_refused(tmp_path):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, config_overrides={"draft_vocab_size": 64})
    with pytest.raises(TensorShapeError, match="'lm_head.weight' has shape \\[70, 32\\], but config field "
                                               "'draft_vocab_size' = 64"):
        load_eagle3_weights(root)


@pytest.mark.parametrize("extra, error, match", [
    ({"d2t": torch.full((70,), 200, dtype=torch.int64)}, CorruptFileError, "outside \\[0, 160\\)"),
    ({"d2t": -torch.arange(70)}, CorruptFileError, "two draft ids to one target id"),
    ({"d2t": torch.zeros(69, dtype=torch.int64)}, TensorShapeError, "'d2t' has shape \\[69\\]"),
    ({"d2t": torch.zeros(70)}, TensorDtypeError, "'d2t' is stored as torch.float32"),
    ({"t2d": torch.ones(160, dtype=torch.bool)}, CorruptFileError, "'t2d' marks 160 target ids"),
    ({"fc.bias": torch.zeros(32)}, UnsupportedTensorError, "'fc.bias' in module 'fc'"),
    ({"midlayer.self_attn.q_proj.bias": torch.zeros(32)}, UnsupportedTensorError, "q_proj.bias"),
])
def test_bad_tensors_are_refused_by_name(tmp_path, extra, error, match):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, extra=extra)
    with pytest.raises(error, match=match):
        load_eagle3_weights(root)


def test_the_embedding_falls_back_to_the_targets_or_is_refused(tmp_path):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, include_embed=False)
    with pytest.raises(MissingTensorError, match="'embed_tokens.weight' is in no file"):
        load_eagle3_weights(root)
    with pytest.raises(TensorShapeError, match="needs its own embed_tokens"):
        load_eagle3_weights(root, target_embed=torch.zeros(160, 24))
    target = torch.randn(160, 32)
    _, weights = load_eagle3_weights(root, target_embed=target)
    assert torch.equal(weights["embed_tokens.weight"], target)


def test_strict_refuses_tensors_no_param_uses(tmp_path):
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG, extra={"mask_hidden": torch.zeros(1, 72)})
    load_eagle3_weights(root)  # tensors of no module the head runs are ignored by default
    with pytest.raises(UnexpectedTensorError, match="'mask_hidden'"):
        load_eagle3_weights(root, strict=True)


def test_an_mtp_checkpoint_is_no_eagle3_drafter(tmp_path):
    from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
    root = write_random_checkpoint(tmp_path / "mtp")
    with pytest.raises(UnsupportedArchitectureError, match="is not an EAGLE-3 drafter"):
        read_eagle3_config(root)
    config = json.loads((root / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_circuit_plan_plans_an_eagle3_checkpoint(tmp_path, capsys):
    from draft_circuit.circuit.cli import main
    root = write_random_eagle3_checkpoint(tmp_path / "e3", CFG)
    out = tmp_path / "plan.json"
    assert main(["plan", "--checkpoint", str(root), "--widths", "1,2", "--num-drafts", "2",
                 "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["notes"]["head"].startswith("Eagle3Head")
    lm = [slot for x in report["widths"][0]["schedule"] for slot in x["inputs"]
          if slot["where"] == "param" and slot["name"] == "lm_head.weight"]
    assert len(lm) == 2 and all(slot["shape"] == [70, 32] for slot in lm)  # the draft rows, 2 steps
    assert any(x["op"] == "map_ids" or any(f.endswith(".draft_id") for f in x["fused"])
               for x in report["widths"][0]["schedule"])  # drafts mapped to target ids
