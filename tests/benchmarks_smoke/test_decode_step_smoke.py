"""CPU smoke test of the decode-step benchmark (benchmarks/decode_step.py): `--device cpu
--quick` runs end to end without touching CUDA, writes its JSON with every field the issue
asks for, before and after, and computes the ratios (whether anything is fast is the H200
run's business, not this test's)."""
import json

import pytest
import torch

from benchmarks import decode_step as ds

STEP_FIELDS = {"wall_us", "gpu_us", "host_us", "chain_gpu_us", "catchup_gpu_us",
               "catchup_replays", "catchup_launches", "catchup_rows", "kv_only_launches",
               "kv_only_floor_us"}


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """A CPU run must never reach CUDA: its events and synchronisation raise here."""
    def refuse(*args, **kwargs):
        raise AssertionError("a --device cpu run called CUDA")
    monkeypatch.setattr(torch.cuda, "Event", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_quick_cpu_run_writes_every_field(tmp_path, capsys, one_thread):
    out, md = tmp_path / "decode_step.json", tmp_path / "RESULTS.md"
    ds.main(["--device", "cpu", "--quick", "--configs", "small,moe", "--out", str(out),
             "--results-md", str(md)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "decode_step" and data["device"] == "cpu"
    assert data["bandwidth_gbps"] > 0 and data["targets"] == ds.TARGETS
    assert set(data["configs"]) == {"tiny", "tiny_moe"}
    assert data["configs"]["tiny_moe"]["head"] == "MoeMtpHead"
    for name, cfg in data["configs"].items():
        assert set(cfg["widths"]) == {"1", "3"}, name
        for n, e in cfg["widths"].items():
            assert "error" not in e, (name, n, e)
            for mode in ds.MODES:
                m = e[mode]
                assert STEP_FIELDS <= set(m), (name, n, mode)
                want = 1 if mode == "pipelined" else data["steps"]  # one block, per-step means
                assert all(len(m["samples"][f]) == want for f in STEP_FIELDS)
                assert m["wall_us"] >= m["gpu_us"] > 0 and m["chain_gpu_us"] > 0
                r = e["ratios"][mode]
                for key in ("wall_over_chain_gpu", "wall_over_chain_floor",
                            "chain_gpu_over_floor", "catchup_over_chain_gpu"):
                    assert r[key] is not None and r[key] > 0, (name, n, mode, key)
                assert set(r["meets"]) >= {"host_us", "wall_over_chain_gpu"}
            # same seeds and acceptances: the two columns caught up the same rows
            assert e["before"]["samples"]["catchup_rows"] == e["after"]["samples"]["catchup_rows"]
            # and the one-call step (step_batch) the same drafts, so the same rows again
            assert e["step"]["samples"]["catchup_rows"] == e["after"]["samples"]["catchup_rows"]
            # after: the catch-up replays the KV-only programs the plan names
            after = e["after"]["samples"]
            assert after["catchup_launches"] == after["kv_only_launches"]
            before = e["before"]["samples"]
            assert all(b >= a for b, a in zip(before["catchup_launches"], after["catchup_launches"]))
            assert e["chain_floor"]["floor_us"] > 0 and e["chain_floor"]["plan_launches"] > 0
            for mode in ds.AGAINST_BEFORE:
                assert set(e["ratios"][f"{mode}_over_before"]) >= {"wall_us", "host_us",
                                                                  "catchup_gpu_us"}
            # the pipelined block replays exactly the KV-only programs its rows need
            assert e["pipelined"]["catchup_launches"] == e["pipelined"]["kv_only_launches"]
    table = capsys.readouterr().out
    assert "| config | n | wall |" in table and "| tiny_moe | 3 |" in table
    assert "<!-- run: decode_step -->" in md.read_text()


def test_host_overhead_is_wall_minus_gpu():
    """The derived fields are computed from the measured ones, step by step."""
    data = ds.main(["--device", "cpu", "--quick", "--configs", "small"])
    m = data["configs"]["tiny"]["widths"]["1"]["after"]["samples"]
    for wall, gpu, host in zip(m["wall_us"], m["gpu_us"], m["host_us"]):
        assert abs(host - (wall - gpu)) < 1e-2
