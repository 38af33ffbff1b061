"""benchmarks/host_ops.py on CPU (issue 14): it drives decode_step's loop, attributes every op
to a proposer call or the driver, and the steady-state step's device ops stay bounded."""
import json

from benchmarks import host_ops


def test_host_ops_runs_and_attributes_ops(tmp_path):
    out = tmp_path / "h.json"
    data = host_ops.main(["--device", "cpu", "--quick", "--configs", "small", "--widths", "1,5",
                          "--steps", "3", "--warmup", "2", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "host_ops"
    for n, e in data["configs"]["tiny"]["widths"].items():
        got = e["after"]
        calls = got["ops"]["calls"]
        assert calls["propose_batch_on_device"]["calls"] == 1.0
        assert calls["catchup_batch"]["calls"] == 1.0
        assert got["time"]["replays"] >= 1  # the chain's, and the catch-up's when rows were kept
        assert got["time"]["host_us"] > 0
        # the driver slices each sequence's catch-up hiddens: its views, not the proposer's
        assert calls["driver"]["device_views"] == int(n)
