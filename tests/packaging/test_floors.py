"""The one-way flow, checked from the source: every import of a project module goes down or
sideways (DESIGN.md, "Floors"), and every import names the one root `draft_circuit`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("circuit", "ops", "runners", "kernels")

# module prefix -> floor, longest prefix wins; a module may import its own floor or lower
FLOORS = {
    "kernels": 0,
    "circuit.types": 1,        # the IR's vocabulary types: the one part of circuit/ below ops
    "ops": 2,
    "circuit": 3,              # IR, builder, verify, binding, passes, memory plan, planner, report
    "circuit.viz": 3,          # reads the plan report only
    "circuit.layers": 4,       # model layers emit circuits through the builder
    "runners": 5,
    "runners.testing": 6,      # public test helpers: the runtime never imports them
    "circuit.cli": 7,          # a command line over layers and planner
    "circuit.cli_args": 7,     # argument types shared by the command lines
}


def floor_of(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def project_modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out.append((".".join(parts), path))
    return out


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import, at any depth (lazy imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", ""))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, str(node.args[0].value)))
    return found


MODULES = project_modules()


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_go_down_and_through_the_root(module: str, path: Path) -> None:
    mine = floor_of(module)
    for line, target in imports_of(path):
        head = target.split(".")[0]
        assert head not in PACKAGES, (f"{path.name}:{line} imports {target!r}: project modules are "
                                      f"imported as draft_circuit.{target}")
        if not target.startswith("draft_circuit."):
            continue
        inner = target[len("draft_circuit."):]
        if inner.split(".")[0] not in PACKAGES:
            continue
        # `from draft_circuit.circuit.ir import Circuit` also yields `...ir.Circuit`: judge the
        # module part by its longest known prefix, which floor_of does
        assert floor_of(inner) <= mine, (f"{module} (floor {mine}) imports {inner} (floor "
                                         f"{floor_of(inner)}) at {path.name}:{line}: floors run "
                                         "one way")


def test_floor_table_names_real_modules() -> None:
    names = {m for m, _ in MODULES}
    for prefix in FLOORS:
        assert any(m == prefix or m.startswith(prefix + ".") for m in names), prefix
