"""The circuit compiler: IR, builder, verifier (passes, memory plan and planner in submodules)."""
import draft_circuit.ops as ops  # noqa: F401  (the registry must be populated before circuits are verified)
from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW, SCHEMA_VERSION, Circuit, CircuitError, Node, TensorSpec, Value
from draft_circuit.circuit.verify import verify

__all__ = ["ROW", "SCHEMA_VERSION", "Circuit", "CircuitBuilder", "CircuitError", "Node",
           "TensorSpec", "Value", "verify"]
