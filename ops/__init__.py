"""The op vocabulary: importing this package registers every op (see ops.registry)."""
from ops import attention, basic, sampling  # noqa: F401  (registration side effects)
from ops import moe  # noqa: F401,E402  (MoE ops and their kernels; after the dense ops)
from ops.bindings import bind_all
from ops.registry import REGISTRY, Cost, CostContext, KernelBinding, OpDef, get_op

bind_all()

__all__ = ["REGISTRY", "Cost", "CostContext", "KernelBinding", "OpDef", "get_op"]
