"""The eager runner: binding checks, error context, freeing after last use, state mutation."""
import pytest
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.binding import BindingError, WidthError
from draft_circuit.runners.eager import EagerRunner, RunError, last_uses


def tiny():
    b = CircuitBuilder("tiny", max_width=4)
    x = b.input("x", "float32", ("n", 3))
    ids = b.input("ids", "int32", ("n",))
    table = b.param("table", "float32", (5, 3))
    e = b.op1("embedding", [table, ids])
    y = b.op1("add", [x, e])
    b.output(b.op1("add", [y, y], name="twice"), "out")
    return b.build()


def test_runs_and_checks_inputs():
    r = EagerRunner(tiny(), {"table": torch.arange(15.0).view(5, 3)}, {})
    out = r.run({"x": torch.ones(2, 3), "ids": torch.tensor([0, 4], dtype=torch.int32)})
    torch.testing.assert_close(out["out"], 2 * (1 + torch.arange(15.0).view(5, 3)[[0, 4]]))
    with pytest.raises(BindingError, match=r"input 'x' must be float32\[2, 3\].*got float32\[2, 4\]"):
        r.run({"x": torch.ones(2, 4), "ids": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(BindingError, match="input 'ids' must be int32"):
        r.run({"x": torch.ones(2, 3), "ids": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(WidthError, match="width 5 is outside"):
        r.run({"x": torch.ones(5, 3), "ids": torch.zeros(5, dtype=torch.int32)})
    with pytest.raises(BindingError, match="missing inputs: ids"):
        r.run({"x": torch.ones(2, 3)})


def test_param_binding_errors():
    with pytest.raises(BindingError, match="missing params: table"):
        EagerRunner(tiny(), {}, {})
    with pytest.raises(BindingError, match=r"param 'table' must be float32\[5, 3\]"):
        EagerRunner(tiny(), {"table": torch.zeros(6, 3)}, {})
    with pytest.raises(BindingError, match="does not declare: extra"):
        EagerRunner(tiny(), {"table": torch.zeros(5, 3), "extra": torch.zeros(1)}, {})


def test_failure_names_the_node():
    r = EagerRunner(tiny(), {"table": torch.zeros(5, 3)}, {})
    with pytest.raises(RunError, match=r"while running node 'embedding' \(embedding; inputs "
                                       r"\(5, 3\):float32, \(2,\):int32\).*token id 9 at row 1"):
        r.run({"x": torch.ones(2, 3), "ids": torch.tensor([1, 9], dtype=torch.int32)})


def test_values_are_freed_after_last_use():
    c = tiny()
    order = c.topo_order()
    freed = last_uses(order, keep=set(c.outputs))
    # x and the embedding die at 'add' (step 1); 'add' dies at 'twice'; the output is kept
    assert sorted(freed[1]) == ["embedding", "x"]
    assert freed[2] == ["add"]
    assert all("out" not in v for v in freed.values())
