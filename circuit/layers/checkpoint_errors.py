"""The typed errors of checkpoint loading: every one is a `CheckpointError` (a ValueError) whose
message names the tensor and the file; config faults are `ConfigError`s (config.py, families.py).
"""
from __future__ import annotations

__all__ = [
    "CheckpointError", "MissingConfigError", "MissingMtpLayerError", "MissingTensorError",
    "TensorShapeError", "CorruptFileError", "UnexpectedTensorError", "UnsupportedTensorError",
    "TensorDtypeError", "NonFiniteTensorError",
]


class CheckpointError(ValueError):
    """A checkpoint directory cannot give the weights asked for."""


class MissingConfigError(CheckpointError):
    """No config.json and no config passed."""


class MissingMtpLayerError(CheckpointError):
    """The config declares an MTP layer but no `eh_proj` is where one may sit."""


class MissingTensorError(CheckpointError):
    """A needed tensor is in no file (after the documented fallbacks)."""


class TensorShapeError(CheckpointError):
    """A tensor's stored shape is not the one the config implies."""


class CorruptFileError(CheckpointError):
    """A safetensors, index or config file is truncated, malformed, absent or contradicts another."""


class UnexpectedTensorError(CheckpointError):
    """strict=True and the checkpoint holds tensors under the loaded prefix that no parameter uses."""


class UnsupportedTensorError(CheckpointError):
    """A tensor inside a module the head runs that the head does not implement (a bias, a q/k
    norm, an MoE gate under a dense MLP): loading around it would change the math silently."""


class TensorDtypeError(CheckpointError):
    """A weight stored as an integer, bool or otherwise unsupported dtype."""


class NonFiniteTensorError(CheckpointError):
    """A weight holding NaN or Inf (as stored, or after conversion to the dtype asked for)."""
