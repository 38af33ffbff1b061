"""The op vocabulary: importing this package registers every op with its kernel bindings (each
declared beside its OpDef; see ops.registry and ops.bindings)."""
from draft_circuit.ops import attention, basic, moe, sampling, tokens  # noqa: F401  (registration)
from draft_circuit.ops import vocab  # noqa: F401  (registration: reduced draft vocabularies)
from draft_circuit.ops import fp8, mla, rope_freqs  # noqa: F401  (registration)
from draft_circuit.ops import family_ops  # noqa: F401  (registration: checkpoint families' ops)
from draft_circuit.ops import fused_linear  # noqa: F401  (registration: launch-saving linears)
from draft_circuit.ops import prologue_linear  # noqa: F401  (registration: norms / adds folded into linears)
from draft_circuit.ops import prologue_argmax  # noqa: F401  (registration: the final norm in the lm-head)
from draft_circuit.ops import kv_only  # noqa: F401  (registration: the KV-only catch-up's fused ops)
from draft_circuit.ops import input_guard  # noqa: F401  (registration: the runners' input guard)
from draft_circuit.ops import collectives  # noqa: F401  (registration: tensor-parallel collectives)
from draft_circuit.ops import vocab_parallel  # noqa: F401  (registration: the lm-head's cross-rank argmax)
from draft_circuit.ops.bindings import Applies, Condition, KernelBinding
from draft_circuit.ops.registry import REGISTRY, TAGS, Cost, CostContext, OpDef, get_op

__all__ = ["REGISTRY", "TAGS", "Applies", "Condition", "Cost", "CostContext", "KernelBinding", "OpDef",
           "get_op"]
