"""The engine with an EAGLE-3 drafter (issue 18): `--draft-checkpoint DIR` holding a random
drafter in the published layout (LlamaForCausalLMEagle3, no embed_tokens: the target's) over a
random Llama target. The target taps the layers the drafter names (or EAGLE-3's default ones),
those taps equal transformers' hidden states of the same layers, and speculative decoding is
token-exact with target-only greedy on both drafter forwards, over the drafter's own draft
vocabulary and over a further subset (`EngineConfig.draft_vocab`). Wrong widths are refused by
name: a drafter for another target width at load, hiddens of another width at propose."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.draft_vocab import DraftVocab
from draft_circuit.circuit.layers.eagle3 import Eagle3Config, Eagle3Head, draft_targets
from draft_circuit.circuit.layers.eagle3_checkpoint import write_random_eagle3_checkpoint
from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.proposer_inputs import HiddenWidthError
from examples.engine import Engine, EngineConfig, EngineError, load_checkpoint
from examples.engine.model import TargetModel, TargetRows
from tests.examples.helpers import SMALL, random_requests

# 8 layers: EAGLE-3's default taps (outputs of layers 1, L/2 - 1, L - 4) are distinct
TARGET = dataclasses.replace(SMALL, num_hidden_layers=8, num_nextn_predict_layers=0)
DRAFTER = Eagle3Config(vocab_size=TARGET.vocab_size, hidden_size=TARGET.hidden_size, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                       rope_theta=TARGET.rope_theta, num_hidden_layers=1, tie_word_embeddings=False,
                       max_position_embeddings=2048, draft_vocab_size=160, target_hidden_size=TARGET.hidden_size)
NAMED = dataclasses.replace(DRAFTER, aux_layer_ids=(6, 0, 3))  # not ascending: concatenated by layer
SETTINGS = dict(num_drafts=3, max_batch=4, kv_blocks=96, block_size=8, widths=(1, 2, 4), max_rows=64)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {"target": write_random_checkpoint(root / "target", TARGET, seed=11),
            "default": write_random_eagle3_checkpoint(root / "default", DRAFTER, seed=12, include_embed=False),
            "named": write_random_eagle3_checkpoint(root / "named", NAMED, seed=13, include_embed=False)}


@pytest.fixture(scope="module")
def requests():
    return random_requests(TARGET.vocab_size, 5, seed=21, max_prompt=20, max_new=(6, 16))


@pytest.fixture(scope="module")
def target_only(dirs, requests):
    ck = load_checkpoint(dirs["target"], with_mtp=False)
    return Engine(ck, EngineConfig(speculate=False, **SETTINGS)).generate(requests).outputs


def test_a_drafter_directory_is_told_by_its_config(dirs):
    ck = load_checkpoint(dirs["target"], draft_path=dirs["default"])
    assert isinstance(ck.mtp_config, Eagle3Config) and ck.mtp is not None
    assert torch.equal(ck.mtp["embed_tokens.weight"], ck.target["model.embed_tokens.weight"])  # borrowed
    assert ck.mtp_config.tapped_layers(TARGET.num_hidden_layers) == (1, 3, 4)


@pytest.mark.parametrize("drafter", ["default", "named"])
def test_taps_are_the_layers_outputs_transformers_gives(dirs, drafter):
    """hidden_states[i + 1] of LlamaModel is layer i's output (i < L - 1; the last is normed)."""
    transformers = pytest.importorskip("transformers")
    ck = load_checkpoint(dirs["target"], draft_path=dirs[drafter])
    taps = ck.mtp_config.tapped_layers(TARGET.num_hidden_layers)
    model = TargetModel(ck.config, ck.target, KvLayout(8, 8, 4), max_rows=16, tap_layers=taps)
    prompt = [5, 77, 3, 201, 9, 14, 150]
    n = len(prompt)
    rows = TargetRows(torch.tensor(prompt, dtype=torch.int32), torch.arange(n, dtype=torch.int32),
                      torch.tensor([[1, 2, 3, 4]] * n, dtype=torch.int32), torch.arange(n, dtype=torch.int32))
    _, got = model.forward(rows)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(dirs["target"]), torch_dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i + 1][0] for i in sorted(taps)], dim=-1)
    assert got.shape == (n, 3 * TARGET.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("drafter", ["default", "named"])
@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_speculation_is_token_exact_with_target_only_greedy(dirs, requests, target_only, drafter, forward):
    engine = Engine(load_checkpoint(dirs["target"], draft_path=dirs[drafter]),
                    EngineConfig(forward=forward, **SETTINGS))
    assert isinstance(engine.proposer.head, Eagle3Head)
    result = engine.generate(requests)
    assert result.outputs == target_only
    assert result.stats.drafted > 0


def _subset(ck, size: int) -> DraftVocab:
    """`size` of the drafter's own draft ids (a subset must lie inside its vocabulary)."""
    held = draft_targets(ck.mtp["d2t"], TARGET.vocab_size)
    return DraftVocab(tuple(held[torch.randperm(held.numel(), generator=torch.Generator().manual_seed(5))][:size].tolist()),
                      TARGET.vocab_size, "test subset")


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_speculation_over_a_draft_vocabulary_is_token_exact(dirs, requests, target_only, forward):
    ck = load_checkpoint(dirs["target"], draft_path=dirs["default"])
    vocab = _subset(ck, 64)
    engine = Engine(ck, EngineConfig(forward=forward, draft_vocab=vocab, **SETTINGS))
    assert engine.proposer.head.draft_vocab_size == 64
    result = engine.generate(requests)
    assert result.outputs == target_only
    allowed = set(vocab.ids)
    assert result.stats.drafted > 0
    # every draft the chain proposes is a subset id: draft one batch directly and look
    seqs_hidden = torch.randn(2, 3 * TARGET.hidden_size)
    states = [engine.proposer.alloc_state() for _ in range(2)]
    engine.proposer.catchup_batch([[7, 8, 9], [4, 5]], [torch.randn(3, 3 * TARGET.hidden_size),
                                                         torch.randn(2, 3 * TARGET.hidden_size)], [1, 1], states)
    drafts = engine.proposer.propose_batch([10, 6], seqs_hidden, [4, 3], 3, states)
    assert drafts is not None and all(t in allowed for row in drafts for t in row)


def test_a_subset_outside_the_drafters_vocabulary_is_refused(dirs):
    ck = load_checkpoint(dirs["target"], draft_path=dirs["default"])
    held = set(draft_targets(ck.mtp["d2t"], TARGET.vocab_size).tolist())
    outside = next(t for t in range(TARGET.vocab_size) if t not in held)
    with pytest.raises(EngineError, match=f"--draft-vocab: .*token id {outside} is not in the head's own"):
        Engine(ck, EngineConfig(draft_vocab=DraftVocab((outside,), TARGET.vocab_size, "bad"), **SETTINGS))


def test_a_drafter_for_another_target_width_is_refused_at_load(dirs, tmp_path):
    other = write_random_eagle3_checkpoint(tmp_path / "wide", dataclasses.replace(DRAFTER, target_hidden_size=64),
                                           seed=3, include_embed=False)
    with pytest.raises(EngineError, match="target_hidden_size 64 != the target's hidden_size 96"):
        load_checkpoint(dirs["target"], draft_path=other)


def test_default_taps_a_shallow_target_cannot_give_are_refused(tmp_path, dirs):
    shallow = write_random_checkpoint(tmp_path / "shallow", dataclasses.replace(TARGET, num_hidden_layers=4), seed=2)
    ck = load_checkpoint(shallow, draft_path=dirs["default"])  # taps (1, 1, 0): one layer twice
    with pytest.raises(EngineError, match=r"tap_layers \[1, 1, 0\]: give distinct target layer indices"):
        Engine(ck, EngineConfig(**SETTINGS))


def test_hiddens_of_another_width_are_a_typed_error(dirs):
    engine = Engine(load_checkpoint(dirs["target"], draft_path=dirs["default"]),
                    EngineConfig(forward="eager", **SETTINGS))
    state = engine.proposer.alloc_state()
    with pytest.raises(HiddenWidthError, match=r"hiddens must be \[1, 288\], got \[1, 96\]: target hiddens 96 wide, the head reads 288"):
        engine.proposer.propose_batch([3], torch.randn(1, TARGET.hidden_size), [2], 3, [state])
    with pytest.raises(HiddenWidthError, match=r"sequence 0: hiddens must be \[rows, 288\].*the head reads 288"):
        engine.proposer.catchup_batch([[1, 2]], [torch.randn(2, TARGET.hidden_size)], [1], [state])


def test_the_command_line_takes_an_eagle3_drafter_and_a_draft_vocabulary(dirs, tmp_path, capsys):
    import json

    from draft_circuit.circuit.layers.draft_vocab import save_draft_vocab
    from examples.engine.__main__ import main
    ck = load_checkpoint(dirs["target"], draft_path=dirs["named"])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5, 9, 2, 33, 17], [7, 1], [40, 41, 42, 43, 44, 45, 46]]))
    vocab = save_draft_vocab(tmp_path / "vocab.json", _subset(ck, 64))
    held = draft_targets(ck.mtp["d2t"], TARGET.vocab_size).tolist()
    corpus = tmp_path / "corpus.json"  # draft ids only, the first 80 of them twice: a top-80 list
    corpus.write_text(json.dumps(held + held[:80]))
    base = ["--checkpoint", str(dirs["target"]), "--prompts", str(prompts), "--max-new-tokens", "10",
            "--quiet", "--forward", "eager", "--widths", "1,2,4", "--threads", str(torch.get_num_threads())]
    eagle = ["--draft-checkpoint", str(dirs["named"])]
    runs = {}
    for name, extra in (("greedy", ["--no-speculation"]), ("eagle3", eagle),
                        ("file", [*eagle, "--draft-vocab", str(vocab)]),
                        ("built", [*eagle, "--draft-vocab", "80", "--draft-vocab-corpus", str(corpus)])):
        out = tmp_path / f"{name}.json"
        assert main([*base, *extra, "--summary-json", str(out)]) == 0, name
        runs[name] = [r["generated"] for r in json.loads(out.read_text())["requests_ids"]]
    assert runs["eagle3"] == runs["file"] == runs["built"] == runs["greedy"]
    capsys.readouterr()
    assert main([*base, *eagle, "--draft-vocab", "80"]) == 2  # N with no corpus, not a byte-level model
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --draft-vocab 80: building 80 ids needs a corpus")
    assert main([*base, *eagle, "--draft-vocab", str(tmp_path / "missing.json")]) == 2
    assert "error: --draft-vocab" in capsys.readouterr().err
