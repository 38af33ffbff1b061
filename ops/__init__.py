"""The op vocabulary: importing this package registers every op (see ops.registry)."""
from draft_circuit.ops import attention, basic, sampling  # noqa: F401  (registration side effects)
from draft_circuit.ops import moe  # noqa: F401,E402  (MoE ops and their kernels; after the dense ops)
from draft_circuit.ops.bindings import bind_all
from draft_circuit.ops.registry import REGISTRY, Cost, CostContext, KernelBinding, OpDef, get_op

bind_all()

__all__ = ["REGISTRY", "Cost", "CostContext", "KernelBinding", "OpDef", "get_op"]
