"""CPU smoke test of benchmarks/engine_step_host.py: both modes at one width, forced acceptance,
every column in the JSON (host us, the bubble after each verify's read, ops and proposer calls
a steady step), and the process left as it was (the greedy rule back: a later test in the same
process, the quick start's, must decode greedily)."""
import json

import torch

import examples.engine.engine as engine_module
from benchmarks import engine_step_host as esh


def test_one_repeat_reports_every_column(tmp_path, one_thread):
    out = tmp_path / "h.json"
    esh.main(["--widths", "2", "--repeats", "1", "--new-tokens", "8", "--accept", "forced",
              "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["accept"] == "forced" and set(got["results"]) == {"ahead", "separate"}
    for mode, calls in (("ahead", "step_batch"), ("separate", "after_verify_batch")):
        res = got["results"][mode]["2"]
        assert res["median_us"] > 0 and res["ops_per_step"] > 0
        assert res["bubble_us"] > 0
        assert res["calls_per_step"][calls] > 0
    # the forced rule and the thread count are put back: later tests decode greedily
    assert engine_module.accept is not esh.forced_accept and torch.get_num_threads() == 1
