"""CPU smoke test of benchmarks/engine_step_host.py: both modes at one width, forced acceptance,
every column in the JSON (host us, the bubble after each verify's read, ops and proposer calls
a steady step), and the process left as it was (the greedy rule back: a later test in the same
process, the quick start's, must decode greedily)."""
import json

import pytest

import torch

import examples.engine.engine as engine_module
from benchmarks import engine_step_host as esh


def test_one_repeat_reports_every_column(tmp_path, one_thread):
    out = tmp_path / "h.json"
    esh.main(["--widths", "2", "--repeats", "1", "--new-tokens", "8", "--accept", "forced",
              "--modes", "ahead,separate", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["accept"] == "forced" and set(got["results"]) == {"ahead", "separate"}
    for mode, calls in (("ahead", "step_batch"), ("separate", "after_verify_batch")):
        res = got["results"][mode]["2"]
        assert res["median_us"] > 0 and res["ops_per_step"] > 0
        assert res["bubble_us"] > 0
        assert res["calls_per_step"][calls] > 0
    # the forced rule and the thread count are put back: later tests decode greedily
    assert engine_module.accept is not esh.forced_accept and torch.get_num_threads() == 1


def test_drafting_before_the_read_is_its_own_mode(tmp_path, one_thread):
    out = tmp_path / "h.json"
    esh.main(["--widths", "2", "--repeats", "1", "--new-tokens", "8", "--modes", "before_read",
              "--out", str(out)])
    res = json.loads(out.read_text())["results"]["before_read"]["2"]
    assert res["median_us"] > 0 and res["bubble_us"] > 0
    assert res["calls_per_step"]["step_ahead"] > 0 and "step_batch" not in res["calls_per_step"]
    with pytest.raises(SystemExit):  # a forced count is the host's: refused by name
        esh.main(["--modes", "before_read", "--accept", "forced"])
