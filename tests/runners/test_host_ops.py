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


#: device ops (kernels and copies on CUDA; views and host tensors apart) a steady-state step may
#: dispatch on CPU, by call, at every width: a device-resident propose stages its hidden (one
#: copy), packs drafts and confidences (one cat) and builds the verify input (its token column
#: and a clamp); a catch-up copies its hiddens and zeroes stale rows in one cat; the read, the
#: trims and the keys are host work. On CUDA add one host-to-device copy a staged run and the
#: drafts' one device-to-host copy (the CPU mirror is the region itself).
BOUNDS = {"propose_batch_on_device": 4, "catchup_batch": 1, "last_drafts": 0, "after_verify": 0,
          "after_verify_batch": 0, "last_pair_key": 0, "last_pair_keys": 0, "propose_batch": 1}


def test_a_steady_state_step_dispatches_a_bounded_number_of_device_ops():
    """The counter of benchmarks/host_ops.py over decode_step's loop at widths 1, 8 and 64
    (the small-batch and array paths), both propose paths: each call's device ops a step stay
    within BOUNDS and no call makes a device view (each is a dispatch: views are made once)."""
    data = host_ops.main(["--device", "cpu", "--quick", "--configs", "small", "--widths",
                          "1,8,64", "--steps", "4", "--warmup", "3", "--modes", "after,before"])
    for n, e in data["configs"]["tiny"]["widths"].items():
        for mode in ("after", "before"):
            calls = e[mode]["ops"]["calls"]
            for name, got in calls.items():
                if name == "driver" or (mode == "before" and name == "catchup_batch"):
                    continue  # the loop's own slices; the full one-step chain's split catch-up
                assert got["device"] <= BOUNDS[name], (n, mode, name, got["ops"])
                assert got["device_views"] == 0, (n, mode, name, got["ops"])
                assert got["host"] == 0, (n, mode, name, got["ops"])
        assert max(e["after"]["ops"]["device_ops_per_step"]) <= 5, n


def test_profiler_events_are_attributed_to_the_call_whose_range_holds_them():
    """host_ops.attribute (the CUDA pass's runtime-call counts) on a CPU profile: each matched
    event counts for the host_ops::<call> range around it, the rest for the driver."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("host_ops::propose"):
            x.fill_(1)
            x.fill_(2)
        x.fill_(3)
        with torch.profiler.record_function("host_ops::catchup_batch"):
            x.fill_(4)
    got = host_ops.attribute(prof.events(), lambda name: name == "aten::fill_")
    assert {k: dict(v) for k, v in got.items()} == {
        "propose": {"aten::fill_": 2}, "driver": {"aten::fill_": 1},
        "catchup_batch": {"aten::fill_": 1}}
