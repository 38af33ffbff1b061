"""FAULTS 27 / issue 19 item 3: one NaN target weight makes every logit row non-finite. The engine
raises NonFiniteLogitsError naming the request and step, with or without speculation (never a
`[-1, -1, ...]` output, never the drafter's TokenError on a -1 token); the command line prints one
`error:` line, exits 1 and writes no summary."""
from __future__ import annotations

import json
import math

import pytest
import torch

from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from examples.engine.runner import NonFiniteLogitsError
from tests.examples.helpers import nan_at_first_verify


def _nan_checkpoint(path, weight="model.layers.0.mlp.down_proj.weight", speculate=True):
    ck = load_checkpoint(path, with_mtp=speculate)
    ck.target[weight] = ck.target[weight].clone()
    ck.target[weight].view(-1)[7] = math.nan
    return ck


@pytest.mark.parametrize("speculate,forward", [(False, "eager"), (True, "eager"), (True, "circuit")])
def test_nan_target_weight_is_an_error_naming_request_and_step(small_checkpoint, speculate, forward):
    engine = Engine(_nan_checkpoint(small_checkpoint, speculate=speculate),
                    EngineConfig(speculate=speculate, forward=forward, widths=(1, 2), max_batch=2))
    with pytest.raises(NonFiniteLogitsError,
                       match=r"request 0: the target's logits at position 0, prefill, are all "
                             r"non-finite"):
        engine.generate([Request([1, 2, 3], 4), Request([4, 5], 4)])


def test_nan_at_a_later_step_names_that_step(small_checkpoint, monkeypatch):
    """Rows go non-finite only after the prefill: the error names the decode step."""
    import examples.engine.runner as runner_module
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(widths=(1,), max_batch=1))
    nan_at_first_verify(engine, monkeypatch)
    with pytest.raises(runner_module.NonFiniteLogitsError, match=r"request 0: .* position \d+, "
                                                                 r"decode step \d+ "):
        engine.generate([Request([1, 2, 3], 12)])


def test_cli_nan_target_is_one_error_line_and_no_summary(capsys, tmp_path, small_checkpoint,
                                                        monkeypatch):
    import examples.engine.__main__ as cli
    monkeypatch.setattr(cli, "load_checkpoint",
                        lambda path, **kw: _nan_checkpoint(path, speculate=kw["with_mtp"]))
    (tmp_path / "p.json").write_text(json.dumps([[1, 2, 3, 4]]))
    summary = tmp_path / "s.json"
    for extra in (["--no-speculation"], []):
        code = cli.main(["--checkpoint", str(small_checkpoint), "--prompts", str(tmp_path / "p.json"),
                         "--max-new-tokens", "4", "--widths", "1,2", "--summary-json", str(summary),
                         "--threads", str(torch.get_num_threads()), *extra])
        out, err = capsys.readouterr()
        assert code == 1 and out == "" and not summary.exists(), (extra, out, err)
        assert err.startswith("error: request 0: the target's logits") and "-1" not in out
        assert "TokenError" not in err and len(err.strip().splitlines()) == 1
