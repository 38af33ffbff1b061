"""What the engine-vs-transformers tests share: transformers' greedy ids with the top-2 logit gap
of each generated token, the comparison that tolerates a different id only after a near tie
(`assert_same_greedy`), and the engine's target alone decoding greedily over TargetRows
(prefill, then one row a step), checked prompt by prompt against a reference.

transformers is a test-only extra: it is imported where a function needs it, so the tests that
use these helpers skip (pytest.importorskip) before they reach them."""
from __future__ import annotations

from typing import Any, Callable

import torch

from examples.engine.model import TargetRows

# three prompts of lengths 10, 3 and 7 (no pad id 0 among them)
PROMPTS = [[5, 9, 2, 33, 17, 8, 41, 3, 12, 60], [7, 1, 44], [2, 2, 50, 61, 19, 23, 30]]


def generate_greedy(model: Any, prompt: list[int], max_new: int, *,
                    attention_mask: bool = True) -> tuple[list[int], list[float]]:
    """`model.generate`'s greedy ids for exactly `max_new` new tokens (eos ignored) and, per
    generated token, the gap between its top two logits. `attention_mask`: pass an explicit
    all-ones mask (generate would otherwise mask prompt tokens equal to pad, 0)."""
    ids = torch.tensor([prompt])
    mask = {"attention_mask": torch.ones_like(ids)} if attention_mask else {}
    with torch.no_grad():
        out = model.generate(ids, **mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


def auto_greedy(path: Any, prompt: list[int], max_new: int, **load: Any) -> tuple[list[int], list[float]]:
    """transformers' AutoModelForCausalLM at `path` (fp32, eager attention, `load` added to
    from_pretrained), greedy with an explicit mask: generate_greedy's ids and gaps."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                              **load).eval()
    return generate_greedy(model, prompt, max_new)


def assert_same_greedy(ours: list[int], theirs: list[int], gaps: list[float]) -> None:
    """Equal ids; a difference is tolerated only after a near tie (top-2 gap < 1e-4), where
    fp32 rounding of a differently ordered sum may pick either token."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert gaps[i] < 1e-4, f"token {i}: engine {a} vs transformers {b} (gap {gaps[i]})"
            return
    assert len(ours) == len(theirs)


def target_greedy(target: Any, prompt: list[int], table: list[int], new: int) -> list[int]:
    """Prefill the prompt as rows, then decode one row a step (the engine's target passes), over
    one sequence's block table; `new` generated ids."""
    def rows(tokens: list[int], start: int) -> TargetRows:
        n = len(tokens)
        return TargetRows(torch.tensor(tokens, dtype=torch.int32), torch.arange(start, start + n, dtype=torch.int32),
                          torch.tensor([table] * n, dtype=torch.int32), torch.arange(start, start + n, dtype=torch.int32))
    out, _ = target.forward(rows(prompt, 0))
    generated = [out[-1]]
    while len(generated) < new:
        out, _ = target.forward(rows([generated[-1]], len(prompt) + len(generated) - 1))
        generated.append(out[0])
    return generated


def assert_target_alone_matches(target: Any, prompts: list[list[int]], new: int,
                                reference: Callable[[list[int]], tuple[list[int], list[float]]]) -> None:
    """Each prompt through target_greedy, its sequence on its own 8 blocks in reverse order (block 0
    is scratch), equals `reference(prompt)`'s (ids, gaps) by assert_same_greedy."""
    for i, prompt in enumerate(prompts):
        table = list(range(1 + 8 * i, 9 + 8 * i))[::-1]
        theirs, gaps = reference(prompt)
        assert_same_greedy(target_greedy(target, prompt, table, new), theirs, gaps)
