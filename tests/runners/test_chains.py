"""One runner protocol for the oracle and the compiled runners; the proposer's runner factory;
`circuit_draft` / `set_circuit_draft` (install a host-compiled runner, remove it: eager drafting,
same drafts); `last_served` says how each propose_batch was served."""
import ast
from pathlib import Path

import pytest
import torch

from draft_circuit.circuit.binding import WidthError
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.chains import DraftBinding, compile_chain, eager_runner
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerDraftRunner
from draft_circuit.runners.protocol import DraftRunner
from draft_circuit.runners.proposer_state import ProposerError
from test_proposer import K, hidden, make, prefilled, seq_kv

ROOT = Path(__file__).resolve().parents[2]


def test_both_runners_implement_the_protocol_with_their_plans():
    p = make("eager")
    binding = p.circuit_draft()
    eager, compiled = eager_runner(binding), compile_chain(binding, (1, 2, 4), device="cpu")
    for runner in (eager, compiled):
        assert isinstance(runner, DraftRunner)
        assert runner.serves(1) and not runner.serves(0) and not runner.serves(9)
    assert eager.max_width == 8 and eager.widths == tuple(range(1, 9))
    assert compiled.max_width == 4 and compiled.widths == (1, 2, 3, 4)
    assert [eager.plan(n).kind for n in (1, 3, 8)] == ["eager"] * 3
    assert [compiled.plan(n).kind for n in (1, 2, 4)] == ["own"] * 3
    assert compiled.plan(3).kind in ("pad", "split")
    for runner in (eager, compiled):
        with pytest.raises(WidthError):
            runner.plan(9)


def test_catchup_binding_runs_rows_in_order():
    p = make("eager")
    one, k = p.circuit_draft(1), p.circuit_draft(K)
    assert one.row_order and not k.row_order
    runner = compile_chain(one, (1, 2, 4, 8), device="cpu")
    assert {runner.plan(n).kind for n in range(1, 9)} <= {"own", "pad"}  # never a split


def test_the_factory_builds_the_chains_a_step_uses_at_construction():
    asked: list[DraftBinding] = []

    def factory(binding: DraftBinding) -> DraftRunner:
        asked.append(binding)
        return eager_runner(binding)
    p = make("circuit", factory=factory)
    assert [(b.circuit.name, b.row_order) for b in asked] == [
        ("mtp_draft_chain", False), ("mtp_draft_chain", True), ("mtp_draft_chain_kv_only", True)]
    assert all(b.states is p.states for b in asked[:2])
    # the KV-only chain binds the very pools it writes (and only those)
    assert sorted(asked[2].states) == ["k_cache", "v_cache"]
    assert all(asked[2].states[n] is p.states[n] for n in asked[2].states)
    s, _ = prefilled(p, 1)
    p.propose(5, hidden(2), 11, K, s)
    assert len(asked) == 3  # built once, kept
    assert p.chain_runner().plan(1).kind == "eager"


def test_set_circuit_draft_installs_and_removes_a_host_compiled_runner():
    p, oracle = make("eager"), make("eager")
    widths = (1, 2, 4, 8)
    installed = {k: compile_chain(p.circuit_draft(k), widths, device="cpu") for k in (K, 1)}
    for k, runner in installed.items():
        p.set_circuit_draft(runner, num_drafts=k)
    assert p.forward == "circuit" and p.chain_runner() is installed[K]
    assert p.chain_runner(1) is installed[1]
    mine, theirs = prefilled(p, 3)[0], prefilled(oracle, 3)[0]
    assert p.stats and set(p.stats) <= {"own", "pad"}  # the 10-row prefill ran compiled
    drafts = p.propose(7, hidden(4), 11, K, mine)
    assert drafts == oracle.propose(7, hidden(4), 11, K, theirs)
    assert torch.equal(seq_kv(p, mine), seq_kv(oracle, theirs))
    got = p.propose_batch([1, 2, 3], hidden(5, 3), [11, 11, 11], K,
                          [prefilled(p, 6 + i)[0] for i in range(3)])
    assert got is not None and p.last_served.kind == installed[K].plan(3).kind
    assert p.last_served.kind in ("pad", "split")  # 3 has no program of its own
    p.set_circuit_draft(None)  # removed: every chain drafts on the oracle
    assert p.forward == "eager" and p.chain_runner().plan(1).kind == "eager"
    assert isinstance(p.chain_runner(), EagerDraftRunner)
    after = p.propose(9, hidden(8), 14, K, mine)
    assert after == oracle.propose(9, hidden(8), 14, K, theirs)
    assert torch.equal(seq_kv(p, mine), seq_kv(oracle, theirs))


def test_set_circuit_draft_refuses_what_cannot_draft_alone():
    p = make("eager")
    with pytest.raises(ProposerError, match="not a DraftRunner"):
        p.set_circuit_draft(object())
    binding = p.circuit_draft()
    wide_only = CircuitDraftRunner(compile_draft(binding.circuit, binding.params, (2,), device="cpu"),
                                   binding.states, policy=WidthPolicy(allow_padding=False))
    with pytest.raises(ProposerError, match="serving width 1"):
        p.set_circuit_draft(wide_only)
    assert p.chain_runner().plan(1).kind == "eager"  # nothing was installed


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_last_served_records_each_batch(forward):
    p, other = make(forward), make(forward)
    states = [prefilled(p, 20 + i)[0] for i in range(3)]
    assert p.propose_batch([1, 2, 3], hidden(1, 3), [11] * 3, K, states) is not None
    want = "eager" if forward == "eager" else p.chain_runner().plan(3).kind
    assert p.last_served.kind == want and p.last_served.width == 3 and p.last_served.ran
    assert p.propose_batch([1, 2], hidden(1, 2), [14, 14], K, [states[0], other.alloc_state()]) is None
    assert p.last_served.kind == "refused" and "another proposer" in p.last_served.reason
    nine = [p.alloc_state() for _ in range(9)]
    assert p.propose_batch([1] * 9, hidden(1, 9), [1] * 9, K, nine) is None
    assert not p.last_served.ran and "width 9 is not served" in p.last_served.reason
    p.refusal = lambda n: "grouped MoE decode disabled"
    assert p.propose_batch([1, 2], hidden(1, 2), [14, 14], K, states[:2]) is None
    assert p.last_served.reason == "grouped MoE decode disabled"


def _isinstance_targets(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
            for arg in ast.walk(node.args[1]):
                if isinstance(arg, ast.Name):
                    names.add(arg.id)
    return names


def test_no_branch_on_a_runners_type_in_the_proposer_or_the_engine():
    files = [*ROOT.glob("runners/proposer*.py"), ROOT / "runners/chains.py",
             *ROOT.glob("examples/engine/*.py")]
    assert len(files) > 8
    runner_types = {"EagerRunner", "EagerDraftRunner", "CircuitDraftRunner", "ProgramRunner",
                    "GraphRunner"}
    for path in files:
        assert not _isinstance_targets(path) & runner_types, path.name


def test_drafter_pools_take_the_shapes_the_head_declares():
    # an MLA head's pools are roped keys and latents, not GQA's K and V: the proposer must
    # allocate what head.cache_shapes says (regression: it assumed kv_heads x head_dim)
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead
    from draft_circuit.runners.proposer_inputs import drafter_pools
    from test_proposer import CFG

    class OtherPools(MtpHead):
        def cache_shapes(self, kv):
            return (kv.num_blocks, kv.block_size, 1, 8), (kv.num_blocks, kv.block_size, 1, 24)
    pools = drafter_pools(OtherPools(CFG), KvLayout(5, 4, 2), 3, "cpu")
    assert pools["k_cache"].shape == (5, 4, 1, 8) and pools["v_cache"].shape == (5, 4, 1, 24)
    assert pools["embed_target"].shape == (3, CFG.hidden_size)
