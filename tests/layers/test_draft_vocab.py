"""A reduced draft vocabulary on any head: the subset chain equals the full chain restricted to the
subset (drafts, subset-renormalised confidences, the grammar mask remapped), ids outside the
subset are never drafted, programs equal the eager oracle bitwise on CPU, the plan's bytes shrink
by the lm-head rows left out; token lists load, build and refuse by name."""

import json
import math

import numpy as np
import pytest
import torch

from draft_circuit.circuit.layers.draft_vocab import (DRAFT_VOCAB_IDS, DraftVocab, DraftVocabError,
                                                      bind_draft_vocab, build_draft_vocab,
                                                      load_draft_vocab, main, save_draft_vocab)
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops.sampling import allowed_tokens, mask_words
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import (assert_program_matches_eager, random_draft_batch, random_mtp_weights,
                                           run_draft_runner, run_side_by_side)
from tests.runners.tiny_chain import tiny_config

CFG = tiny_config()
KV = KvLayout(num_blocks=80, block_size=8, max_blocks_per_seq=4)
K, S = 3, 45  # 45 ids: the subset mask's last word is partial


def subset(seed: int = 0, size: int = S) -> DraftVocab:
    g = torch.Generator().manual_seed(seed)
    return DraftVocab(tuple(torch.randperm(CFG.vocab_size, generator=g)[:size].tolist()), CFG.vocab_size)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[n, V] bool -> [n, ceil(V/32)] int32 words (bit v & 31 of word v >> 5)."""
    n, v = allowed.shape
    words = torch.zeros(n, mask_words(v), dtype=torch.int64)
    for t in range(v):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def in_subset(vocab: DraftVocab, n: int) -> torch.Tensor:
    row = torch.zeros(CFG.vocab_size, dtype=torch.bool)
    row[list(vocab.ids)] = True
    return row.expand(n, -1)


def setup(width: int, masked: bool, seed: int = 1):
    head, vocab = MtpHead(CFG), subset()
    weights = random_mtp_weights(CFG, seed=5)
    full = emit_draft_chain(head, K, max_width=8, kv=KV, bitmask=True, embed_target=True)
    sub = emit_draft_chain(head, K, max_width=8, kv=KV, bitmask=masked, embed_target=True,
                           draft_vocab=S)
    params = head.bind(weights)
    batch = random_draft_batch(CFG, KV, width, seed=seed, num_drafts=K, bitmask=True)
    return head, vocab, full, sub, params, bind_draft_vocab(params, head, vocab), batch


def run(chain, params, batch, inputs):
    states = {**batch.clone_states(), "embed_target": torch.zeros(8, CFG.hidden_size)}
    return EagerRunner(chain, params, states).run(inputs), states


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("width", [1, 3, 8])
def test_subset_chain_is_the_full_chain_restricted_to_the_subset(width, masked):
    """The full head under mask (grammar & subset) drafts what the subset head drafts under the
    grammar mask alone: the same tokens and hidden states, and confidences renormalised over
    the same allowed tokens (logit - logsumexp over subset & grammar)."""
    head, vocab, full, sub, params, sub_params, batch = setup(width, masked)
    grammar = batch.inputs["bitmask"]
    if masked and width > 1:
        grammar[1] = pack(~in_subset(vocab, 1))  # row 1: nothing of the subset allowed -> -1
    allowed = allowed_tokens(grammar, CFG.vocab_size) if masked else torch.ones(width, CFG.vocab_size, dtype=torch.bool)
    want, want_states = run(full, params, batch, {**batch.inputs, "bitmask": pack(allowed & in_subset(vocab, width))})
    inputs = dict(batch.inputs) if masked else {k: v for k, v in batch.inputs.items() if k != "bitmask"}
    got, got_states = run(sub, sub_params, batch, inputs)
    assert torch.equal(got["drafts"], want["drafts"])
    assert torch.equal(got["hidden_out"], want["hidden_out"])
    for name in want_states:
        assert torch.equal(got_states[name], want_states[name]), name
    torch.testing.assert_close(got["confidences"], want["confidences"], atol=1e-5, rtol=0)
    if masked and width > 1:
        assert got["drafts"][1, 0] == -1 and got["confidences"][1, 0] == float("-inf")
    assert (got["drafts"] >= 0).sum() > 0


def test_ids_outside_the_subset_are_never_drafted():
    """Rows of the lm-head outside the subset scaled up, so the full head would pick them."""
    head, vocab = MtpHead(CFG), subset(seed=3)
    weights = random_mtp_weights(CFG, seed=2)
    outside = torch.ones(CFG.vocab_size, dtype=torch.bool)
    outside[list(vocab.ids)] = False
    weights["shared_head.head.weight"][outside] *= 8
    batch = random_draft_batch(CFG, KV, 8, seed=4, num_drafts=K)
    full = emit_draft_chain(head, K, max_width=8, kv=KV)
    sub = emit_draft_chain(head, K, max_width=8, kv=KV, draft_vocab=S)
    wide = EagerRunner(full, head.bind(weights), batch.clone_states()).run(batch.inputs)["drafts"]
    drafts = EagerRunner(sub, bind_draft_vocab(head.bind(weights), head, vocab),
                         batch.clone_states()).run(batch.inputs)["drafts"]
    assert bool(outside[wide.long()].any()), "the test needs a full head that drafts outside"
    assert set(drafts.flatten().tolist()) <= set(vocab.ids)


@pytest.mark.parametrize("masked", [False, True])
def test_programs_equal_the_eager_chain_bitwise_at_every_width(masked):
    head, vocab, _, _, params, sub_params, _ = setup(1, masked)
    chain = emit_draft_chain(head, K, max_width=8, kv=KV, bitmask=masked, embed_target=True,
                             confidence_stop=True, draft_vocab=S)

    def batch_for(n: int) -> tuple[dict, dict]:
        batch = random_draft_batch(CFG, KV, n, seed=10 + n, num_drafts=K, bitmask=masked)
        batch.inputs["log_tau"] = torch.full((n,), math.log(0.02))
        return batch.inputs, {**batch.states(), "embed_target": torch.zeros(8, CFG.hidden_size)}

    compiled = assert_program_matches_eager(chain, sub_params, range(1, 9), batch_for, run_program=run_draft_runner)
    ops = {x.op for x in compiled.programs[1].launches}
    # the ids ride in the lm-head argmax (issue 18); the mask is remapped once a chain
    assert "map_ids" not in ops and ("remap_bitmask" in ops) == masked
    argmax = [n for n in compiled.circuit.nodes if n.op.startswith("rmsnorm_linear_argmax_keep")]
    assert len(argmax) == K and all(n.attrs.get("ids") and n.inputs[-1] == DRAFT_VOCAB_IDS for n in argmax)


@pytest.mark.parametrize("width", [1, 3])
def test_triton_fused_subset_head_matches_eager(width):
    """The fused lm-head kernel (interpreted) over the gathered rows, the mask remapped."""
    head, vocab, _, sub, _, sub_params, batch = setup(width, True, seed=20 + width)
    compiled = compile_draft(sub, sub_params, [width], options=CompileOptions(interpret_kernels=True))
    # the final norm rides in the fused lm-head's prologue (issue 15), the ids and keep_if_active
    # in its merge (issue 18: map_ids no longer stands between the argmax and the keep)
    kernels = {x.kernel for x in compiled.programs[width].launches}
    assert "triton_rmsnorm_linear_argmax_keep" in kernels and "reference" not in {
        x.kernel for x in compiled.programs[width].launches if x.step is not None}
    states = {**batch.states(), "embed_target": torch.zeros(8, CFG.hidden_size)}
    r = run_side_by_side(sub, sub_params, compiled, batch.inputs, states)
    assert torch.equal(r.got["drafts"], r.want["drafts"])
    torch.testing.assert_close(r.got["confidences"], r.want["confidences"], atol=1e-5, rtol=1e-5)


def lm_head_bytes(width_report) -> int:
    """The lm-head weight bytes a width's launches read (whichever fused op reads it)."""
    return sum(2 * math.prod(slot.shape) for x in width_report.schedule for slot in x.inputs
               if slot.where == "param" and slot.name == "shared_head.head.weight")


def test_plan_bytes_and_floor_shrink_by_the_rows_left_out():
    head = MtpHead(CFG, "bfloat16")
    meta = lambda c: {v.name: torch.empty(v.shape, device="meta", dtype=getattr(torch, v.dtype))  # noqa: E731
                      for v in c.values if v.kind == "param"}
    reports = []
    for size in (None, S):
        chain = emit_draft_chain(head, K, max_width=4, kv=KV, draft_vocab=size)
        reports.append(compile_draft(chain, meta(chain), [1, 4], device="cuda").report())
    for full, sub in zip(reports[0].widths, reports[1].widths):
        assert lm_head_bytes(full) - lm_head_bytes(sub) == K * (CFG.vocab_size - S) * CFG.hidden_size * 2
        assert sub.bytes_moved < full.bytes_moved and sub.floor_us < full.floor_us
        # the ids are read in the lm-head merge: one int32 a row, no launch of their own (issue 18)
        assert "torch_map_ids" not in {x.kernel for x in sub.schedule}
        assert sub.gpu_launches == full.gpu_launches


def test_bound_rows_ascend_and_the_table_maps_back():
    head, vocab = MtpHead(CFG), subset()
    params = head.bind(random_mtp_weights(CFG, seed=5))
    bound = bind_draft_vocab(params, head, vocab)
    ids = bound[DRAFT_VOCAB_IDS]
    assert ids.dtype == torch.int32 and ids.tolist() == sorted(vocab.ids)
    assert torch.equal(bound["shared_head.head.weight"], params["shared_head.head.weight"][ids.long()])
    assert bound["embed_tokens.weight"] is params["embed_tokens.weight"]  # embeddings stay target-wide


def test_a_subset_of_a_subset_keeps_the_rows_it_holds():
    head = MtpHead(CFG)
    params = head.bind(random_mtp_weights(CFG, seed=5))
    outer = bind_draft_vocab(params, head, subset(size=60))
    inner = DraftVocab(subset(size=60).ids[:20], CFG.vocab_size)
    twice = bind_draft_vocab(outer, head, inner)
    assert torch.equal(twice["shared_head.head.weight"], bind_draft_vocab(params, head, inner)["shared_head.head.weight"])
    stranger = DraftVocab(tuple(sorted(set(range(CFG.vocab_size)) - set(subset(size=60).ids))[:3]),
                          CFG.vocab_size)
    with pytest.raises(DraftVocabError, match="not in the head's own draft vocabulary"):
        bind_draft_vocab(outer, head, stranger)


def test_chain_refuses_a_subset_size_the_head_cannot_have():
    for bad in (0, CFG.vocab_size + 1, True):
        with pytest.raises(DraftVocabError, match="draft_vocab"):
            emit_draft_chain(MtpHead(CFG), K, max_width=2, kv=KV, draft_vocab=bad)
    chain = emit_draft_chain(MtpHead(CFG), K, max_width=2, kv=KV, bitmask=True, draft_vocab=S)
    assert chain.value("bitmask").shape[1] == mask_words(CFG.vocab_size)  # the host's mask: target ids
    assert chain.value(DRAFT_VOCAB_IDS).shape == (S,)


# ---- token lists: files, corpora, refusals ----
def test_token_lists_round_trip_through_every_format(tmp_path):
    vocab = subset()
    save_draft_vocab(tmp_path / "v.json", vocab)
    torch.save(torch.tensor(vocab.ids), tmp_path / "v.pt")
    np.save(tmp_path / "v.npy", np.array(vocab.ids, dtype=np.int64))
    for name in ("v.json", "v.pt", "v.npy"):
        assert load_draft_vocab(tmp_path / name, CFG.vocab_size).ids == vocab.ids
    assert load_draft_vocab(tmp_path / "v.json", CFG.vocab_size, size=5).ids == vocab.ids[:5]


@pytest.mark.parametrize("content, match", [
    ([1, 2, 2], "listed more than once"), ([1, 150], "outside the target vocabulary"),
    ([], "empty token list"), ({"ids": [1]}, "list of integer"), ([1.0, 2.0], "list of integer"),
])
def test_bad_token_lists_are_refused_by_name(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DraftVocabError, match=match) as e:
        load_draft_vocab(path, CFG.vocab_size)
    assert str(path) in str(e.value)


def test_unreadable_token_files_are_refused(tmp_path):
    torch.save(torch.ones(3), tmp_path / "f.pt")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object))
    (tmp_path / "v.txt").write_text("1 2 3")
    (tmp_path / "t.json").write_text("[1, 2")
    for name, match in (("f.pt", "1-D integer tensor"), ("o.npy", "cannot read"),
                        ("v.txt", r"\.json, \.pt or \.npy"), ("t.json", "cannot read")):
        with pytest.raises(DraftVocabError, match=match):
            load_draft_vocab(tmp_path / name, CFG.vocab_size)
    with pytest.raises(DraftVocabError, match="cannot keep 60"):
        subset(size=50).top(60)


def test_a_corpus_gives_its_most_frequent_ids_first(tmp_path):
    corpus = [7] * 5 + [3] * 5 + [9] * 2 + [1]
    assert build_draft_vocab(corpus, 10, 3).ids == (3, 7, 9)  # a tie: the lower id first
    with pytest.raises(DraftVocabError, match="fewer than the 5"):
        build_draft_vocab(corpus, 10, 5)
    with pytest.raises(DraftVocabError, match="outside the target vocabulary"):
        build_draft_vocab([12], 10, 1)
    (tmp_path / "c.json").write_text(json.dumps(corpus))
    assert main(["--corpus", str(tmp_path / "c.json"), "--vocab-size", "10", "--size", "2",
                 "--out", str(tmp_path / "top.json")]) == 0
    assert json.loads((tmp_path / "top.json").read_text()) == [3, 7]
    with pytest.raises(SystemExit) as e:
        main(["--corpus", str(tmp_path / "c.json"), "--vocab-size", "10", "--size", "9",
              "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2


def test_a_list_for_another_vocabulary_is_refused():
    head = MtpHead(CFG)
    with pytest.raises(DraftVocabError, match="target vocabulary has 150"):
        bind_draft_vocab(head.bind(random_mtp_weights(CFG)), head, DraftVocab((1, 2), 200))


def test_circuit_plan_takes_a_draft_vocabulary(tmp_path, capsys):
    from draft_circuit.circuit.cli import main
    from draft_circuit.circuit.report import PlanReport
    args = ["plan", "--widths", "1", "--num-drafts", "2", "--device", "cpu"]
    reports = {}
    for name, extra in (("full", []), ("n", ["--draft-vocab", "64"]), ("file", ["--draft-vocab", str(tmp_path / "v.json")])):
        if name == "file":
            save_draft_vocab(tmp_path / "v.json", DraftVocab(tuple(range(64)), 256))
        assert main([*args, *extra, "--json", str(tmp_path / f"{name}.json")]) == 0
        reports[name] = PlanReport.from_json((tmp_path / f"{name}.json").read_text()).widths[0]
    assert reports["n"].bytes_moved == reports["file"].bytes_moved < reports["full"].bytes_moved
    assert lm_head_bytes(reports["full"]) - lm_head_bytes(reports["n"]) == 2 * (256 - 64) * 128 * 2
    assert main([*args, "--draft-vocab", "300"]) == 2  # more ids than the embedded default's 256
    assert "draft_vocab = 300" in capsys.readouterr().err


def test_a_moe_head_drafts_over_a_subset_too():
    from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, random_moe_weights
    moe = MoeConfig(**{**CFG.__dict__}, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    n_shared_experts=1)
    head, vocab = MoeMtpHead(moe), subset(seed=5)
    params = bind_draft_vocab(head.bind(random_moe_weights(moe, seed=1)), head, vocab)
    chain = emit_draft_chain(head, K, max_width=4, kv=KV, draft_vocab=S)
    batch = random_draft_batch(CFG, KV, 3, seed=6, num_drafts=K)
    drafts = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs)["drafts"]
    assert params["shared_head.head.weight"].shape == (S, CFG.hidden_size)
    assert set(drafts.flatten().tolist()) <= set(vocab.ids)
