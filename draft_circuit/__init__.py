"""draft-circuit's import root: `draft_circuit.circuit`, `.ops`, `.runners`, `.kernels`.

The packages live in the repository's top-level folders (the design card's layout) but install
under this one root, so the wheel never writes a top-level `circuit`, `ops`, `runners` or
`kernels` that another distribution owns (Hugging Face's `kernels`, say). Installed, the
subpackages sit beside this file. From a source checkout (or an editable install) they are the
folders beside this one, so the checkout's root joins this package's search path.
"""
from __future__ import annotations

import os

_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_here, "circuit")):
    __path__.append(os.path.dirname(_here))  # noqa: F821  (the package's own search path)
