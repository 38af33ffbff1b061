"""examples/train_tiny.py: its torch model is the engine's target and the proposer's MTP chain
(same maths, same checkpoint names), and a few-step run writes a checkpoint the engine loads."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from examples import stdlib_corpus, train_tiny
from examples.engine import load_checkpoint
from examples.engine.checkpoints import EMBEDDED
from examples.engine.model import TargetModel, TargetRows
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead
from draft_circuit.runners.proposer import MtpProposer
from tests.examples.helpers import SMALL


def _trained_like(seed: int = 0) -> train_tiny.TinyLlama:
    """Random weights, norms moved off 1 so a misplaced norm shows, rounded to bf16."""
    torch.manual_seed(seed)
    model = train_tiny.TinyLlama(SMALL)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    train_tiny.round_to(model, torch.bfloat16)  # what export writes: the engine reads these values
    return model.eval()


def test_exported_model_is_the_engine_target_and_the_proposer_chain(tmp_path):
    model = _trained_like()
    train_tiny.export(model, tmp_path / "ck")
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.byte_level
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, 24), generator=g)
    with torch.no_grad():
        h, logits = model.target(tokens)

    # the target: the engine's circuit gives the training model's hiddens and greedy tokens
    kv = KvLayout(num_blocks=9, block_size=16, max_blocks_per_seq=4)
    target = TargetModel(ck.config, ck.target, kv, max_rows=64)
    n = tokens.shape[1]
    rows = TargetRows(tokens[0].int(), torch.arange(n, dtype=torch.int32),
                      torch.tensor([[1, 2, 0, 0]] * n, dtype=torch.int32),
                      torch.arange(n, dtype=torch.int32))
    greedy, hidden = target.forward(rows)
    torch.testing.assert_close(hidden, h[0], atol=1e-5, rtol=1e-5)
    assert greedy == logits[0].argmax(-1).tolist()

    # the chain: the proposer's drafts are the teacher-forced chain's argmax along its own drafts
    k, P = 4, 12
    head = MtpHead(ck.mtp_config)
    proposer = MtpProposer(head, head.bind(ck.mtp), num_drafts=k, num_blocks=9,
                           max_blocks_per_seq=4, forward="eager", widths=(1,), max_width=1)
    state = proposer.alloc_state()
    prompt = tokens[0, :P].tolist()
    proposer.prefill_drafter(prompt, h[0, :P], state)
    drafts = proposer.propose(int(tokens[0, P]), h[0, P - 1], P, k, state)
    seq = torch.tensor([prompt + [int(tokens[0, P])] + drafts[:-1]])
    with torch.no_grad():
        h_seq, _ = model.target(seq)
        chain = model.chain(seq, h_seq, k)
    # step s (1-based) at position p = P + s - 1 sits at index p - 1
    assert [int(chain[s - 1][0, P + s - 2].argmax()) for s in range(1, k + 1)] == drafts


def test_few_step_runs_write_the_same_loadable_checkpoint(tmp_path):
    """The default shape (train_tiny.CONFIG, the embedded default's) for a few CPU steps: same
    seed, same bytes; a bf16 checkpoint the engine loads, with its log, result and prompts."""
    def train(name: str) -> bytes:
        out = tmp_path / name
        train_tiny.main(["--out", str(out), "--device", "cpu", "--steps", "2", "--distil-steps", "1",
                         "--batch", "2", "--seq-len", "32", "--eval-seqs", "2", "--eval-len", "48"])
        return (out / "model.safetensors").read_bytes()

    first = train("a")
    assert train("b") == first, "same seed, same bytes"
    ck = load_checkpoint(tmp_path / "a")
    assert ck.byte_level and ck.mtp is not None and ck.config == train_tiny.CONFIG
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert len(first) < 16_000_000
    assert json.loads((tmp_path / "a" / "heldout_prompts.json").read_text())
    result = json.loads((tmp_path / "a" / "train_result.json").read_text())
    assert result["steps"] == 3 and len(result["held_out"]["step_agreement"]) == 4
    log = (tmp_path / "a" / "train_log.txt").read_text()
    assert "held out" in log and "joint step 0/2" in log and "distil step 0/1" in log


def test_wall_time_cap_ends_each_phase(tmp_path):
    """--max-minutes 0: both phases stop before their first step, and the run still evaluates
    and writes a loadable checkpoint (the cap never loses the run)."""
    out = tmp_path / "capped"
    train_tiny.main(["--out", str(out), "--device", "cpu", "--steps", "5", "--distil-steps", "5",
                     "--batch", "2", "--seq-len", "32", "--eval-seqs", "1", "--eval-len", "40",
                     "--max-minutes", "0"])
    assert json.loads((out / "train_result.json").read_text())["steps"] == 0
    assert (out / "train_log.txt").read_text().count("wall-time cap reached after 0 of 5 steps") == 2
    assert load_checkpoint(out).mtp is not None


def test_corpus_is_the_stdlib_source_with_whole_files_held_out():
    train, held = stdlib_corpus.stdlib_files()
    assert sorted(f.name for f in held) == sorted(stdlib_corpus.HELD_OUT)
    assert not set(held) & set(train)
    assert not any("test" in f.parts for f in train)
    assert any(f.parent.name == "json" for f in train)  # packages are in the corpus


def test_embedded_checkpoint_is_small():
    path = EMBEDDED / "model.safetensors"
    if path.is_file():
        assert path.stat().st_size < 16_000_000


def test_init_distils_the_mtp_head_further_and_keeps_the_target(tmp_path):
    """`--init DIR --steps 0`: the MTP layer continues from the checkpoint (distilled, here in
    place: --init is --out), every target tensor and the MTP layer's copies of the target's
    embedding and head written back bit for bit, so target-only greedy output cannot change;
    the log is the first run's, then this one's; with no steps, checkpoint and held-out prompts
    come back byte for byte. A checkpoint of another shape is refused, naming the field."""
    common = ["--device", "cpu", "--batch", "2", "--seq-len", "32", "--eval-seqs", "2",
              "--eval-len", "48"]
    base, more = tmp_path / "base", tmp_path / "more"
    train_tiny.main(["--out", str(base), "--steps", "2", "--distil-steps", "1", *common])
    shutil.copytree(base, more)
    # a large rate: a few steps' updates must survive the bf16 rounding of the export
    train_tiny.main(["--out", str(more), "--init", str(more), "--steps", "0", "--distil-steps", "2",
                     "--lr", "3", *common])
    mtp = f"model.layers.{train_tiny.CONFIG.num_hidden_layers}."
    with safe_open(base / "model.safetensors", "pt") as a, \
            safe_open(more / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        changed = {k for k in a.keys() if not torch.equal(a.get_tensor(k), b.get_tensor(k))}
    assert mtp + "eh_proj.weight" in changed
    assert all(k.startswith(mtp) for k in changed), sorted(changed)
    assert not changed & {mtp + "embed_tokens.weight", mtp + "shared_head.head.weight"}
    log = (more / "train_log.txt").read_text()
    assert log.startswith((base / "train_log.txt").read_text())
    assert f"init: {more}" in log and "distil step 0/2" in log
    assert json.loads((more / "train_result.json").read_text())["steps"] == 2
    assert load_checkpoint(more).mtp is not None
    # no steps: the checkpoint and its prompts written back as they were (prompts another
    # Python cut from its own standard library: kept, not cut again from this one's)
    (more / "heldout_prompts.json").write_text(json.dumps(["def f(x):\n    return"]) + "\n")
    again = tmp_path / "again"
    train_tiny.main(["--out", str(again), "--init", str(more), "--steps", "0", "--distil-steps",
                     "0", *common])
    for name in ("model.safetensors", "config.json", "heldout_prompts.json"):
        assert (again / name).read_bytes() == (more / name).read_bytes(), name

    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | {"hidden_size": 64}))
    with pytest.raises(SystemExit, match="hidden_size"):
        train_tiny.main(["--out", str(tmp_path / "x"), "--init", str(base), "--steps", "0",
                         *common])
