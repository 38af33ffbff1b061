"""The embedded default's corpus: this Python's standard library source as bytes, split by whole
files into training and held-out (HELD_OUT), and the held-out prompts written beside the model.
examples/train_tiny.py trains on it; the engine's `--draft-vocab N` on the byte-level default
counts its bytes to pick the N most frequent."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

# held out from training (those this Python has); prompts for the acceptance measure come from them
HELD_OUT = ("bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "sched.py", "shlex.py",
            "struct.py", "textwrap.py")
# not part of the corpus: the test suites (data files, generated cases) and third-party packages
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every .py of this Python's standard library, packages
    included, but not its test suites; HELD_OUT are top-level modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(root).parts))
    held = [f for f in files if f.parent == root and f.name in HELD_OUT]
    return [f for f in files if f not in held], held


def read_bytes(files: list[Path]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n\n".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def write_prompts(files: list[Path], path: Path, count: int = 16) -> None:
    """Held-out prompts: `count` snippets (40-200 bytes) of the held-out files, each starting at
    a line and ending wherever its length says (often mid-line: a continuation to complete)."""
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(count):
        lines = files[i % len(files)].read_text().splitlines(keepends=True)
        start = int(torch.randint(0, max(len(lines) - 12, 1), (1,), generator=gen))
        want = 40 + int(torch.randint(0, 160, (1,), generator=gen))
        text = "".join(lines[start:start + 40])[:want]
        prompts.append(text.encode("ascii", "replace").decode("ascii"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prompts, indent=1) + "\n")
