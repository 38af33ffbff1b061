"""moe_route's selection on CPU gives a row the bits it has alone, wherever it sits in the batch:
torch's vectorised sigmoid / softmax round a value in the main loop and in the scalar tail
differently, so one call over the batch made a row's routing weights depend on its neighbours
(an AVX2 machine: the sharded MoE chain's row alone != the same row in a batch of 4)."""
import pytest
import torch

from draft_circuit.ops.moe import MoeRouteAttrs, route_select


@pytest.mark.parametrize("scoring,experts,n_group", [("sigmoid", 4, 2), ("sigmoid", 64, 8),
                                                    ("softmax", 4, 1), ("softmax", 64, 1)])
def test_a_rows_route_is_its_route_alone(scoring, experts, n_group):
    a = MoeRouteAttrs(top_k=2, n_group=n_group, topk_group=1 if n_group > 1 else 1,
                      scoring_func=scoring, norm_topk_prob=True, routed_scaling_factor=2.0)
    g = torch.Generator().manual_seed(experts)
    # rows enough that some sit in the vectorised main loop and some in its tail
    logits = torch.randn(64, experts, generator=g) * 3
    ids, weights = route_select(logits, None, a)
    for n in (1, 4, 8, 13):
        got_ids, got_w = route_select(logits[:n], None, a)
        assert torch.equal(got_ids, ids[:n]) and torch.equal(got_w, weights[:n]), n
    for r in range(64):
        alone_ids, alone_w = route_select(logits[r:r + 1].clone(), None, a)
        assert torch.equal(alone_ids[0], ids[r]) and torch.equal(alone_w[0], weights[r]), r
