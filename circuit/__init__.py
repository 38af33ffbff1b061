"""The circuit compiler: IR, builder, verifier (passes, memory plan and planner in submodules)."""
import ops  # noqa: F401  (the registry must be populated before circuits are verified)
from circuit.builder import CircuitBuilder
from circuit.ir import ROW, SCHEMA_VERSION, Circuit, CircuitError, Node, TensorSpec, Value
from circuit.verify import verify

__all__ = ["ROW", "SCHEMA_VERSION", "Circuit", "CircuitBuilder", "CircuitError", "Node",
           "TensorSpec", "Value", "verify"]
