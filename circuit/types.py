"""The IR's vocabulary types: dtypes, the row symbol, `TensorSpec` and `CircuitError`.

The one part of the compiler the op vocabulary sits above (ops/ imports this and nothing else of
circuit/), so shape rules and references speak the IR's types without importing the IR.
"""
from __future__ import annotations

from typing import Union

from pydantic import BaseModel, ConfigDict

ROW = "n"  # the row symbol: the batch width a program is specialised for

Dim = Union[int, str]

# dtype names as torch spells them; the short forms are for printing only
DTYPES: dict[str, str] = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16",
    "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "b8",
    "float8_e4m3fn": "f8e4m3",  # FP8 expert weights (DeepSeek-V3 block-scaled checkpoints)
}
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1,
}


class CircuitError(ValueError):
    """A malformed circuit or a failed circuit rule; names the node, the op, the shapes and the
    origin (the layer line that built the node, when known)."""

    def __init__(self, message: str, *, node: str | None = None, op: str | None = None,
                 shapes: str | None = None, origin: str | None = None) -> None:
        self.node, self.op, self.shapes, self.detail = node, op, shapes, message
        self.origin = origin
        where = f"node {node!r}" + (f" (op {op})" if op else "") if node else (f"op {op}" if op else "")
        text = f"{where}: {message}" if where else message
        if shapes:
            text += f" [{shapes}]"
        if origin:
            text += f" (built at {origin})"
        super().__init__(text)


class TensorSpec(BaseModel):
    """The dtype and shape of a tensor; a shape entry is an int or a declared symbol (`n`)."""

    model_config = ConfigDict(frozen=True)
    dtype: str
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{DTYPES.get(self.dtype, self.dtype)}[{','.join(str(d) for d in self.shape)}]"

    def concrete(self, env: dict[str, int]) -> tuple[int, ...]:
        """The shape with every symbol replaced by its value in `env`."""
        shape = self.shape
        for d in shape:
            if not isinstance(d, int):
                return tuple(d if isinstance(d, int) else env[d] for d in shape)
        return shape  # type: ignore[return-value]  # every entry an int: already concrete

    def nbytes(self, env: dict[str, int]) -> int:
        numel = 1
        for d in self.concrete(env):
            numel *= d
        return numel * DTYPE_BYTES[self.dtype]
