"""The GPU test's comparison on CPU (tests/runners/test_families_cuda.py): each family's bf16 MTP
chain, run by the eager runner in the captured chain's place (torch's CPU bf16 math, which the
Triton interpreter lacks), against the fp32 eager oracle under the same near-tie rule, on the
same config, weights and batches.

It pins that the rule and its thresholds suit bf16 rounding for these heads, so a GPU failure
of that test points at a kernel rather than at the rule. For GLM-4.5's sigmoid top-1 router the
lm-head-only rule holds here (measured: 91 steps compared, 1 mismatched); Qwen3-Next's softmax
top-2 router needed the router's own near-tie rule (tests/layers/test_qwen3_next_bf16.py).
"""
import pytest
import torch

from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import random_draft_batch

from tests.runners.test_families_cuda import HEADS, KV, K, WIDTHS, against_oracle, build, enough


@pytest.mark.parametrize("family", sorted(HEADS))
def test_bf16_eager_chain_passes_the_gpu_tests_rule(family):
    config, chain, fp32_chain, params, fp32_params = build(family, "cpu")
    compared = mismatched = 0
    for n in WIDTHS:
        batch = random_draft_batch(config, KV, n, seed=10 + n, num_drafts=K, device="cpu", dtype=torch.bfloat16)
        got = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs)
        c, m = against_oracle(got, batch, fp32_chain, fp32_params)
        compared, mismatched = compared + c, mismatched + m
    assert enough(compared, mismatched), (compared, mismatched)
