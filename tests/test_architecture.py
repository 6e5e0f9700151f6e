"""The layout stays what docs/architecture.md says: every module it names exists and every
module exists in it, no module passes 400 lines, each opens with a docstring and has __all__,
and no stage imports a stage below it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autobatch"
DOC = (ROOT / "docs" / "architecture.md").read_text()

# Which top-level parts each part may import (itself always). Lower stages never import higher ones.
FOUNDATION = {"errors", "units", "modelinfo", "strategy"}
ALLOWED = {
    "errors": set(),
    "units": {"errors"},
    "modelinfo": {"errors"},
    "strategy": {"errors"},
    "probing": FOUNDATION,
    "planning": FOUNDATION,
    "guard": FOUNDATION | {"probing", "checking"},
    "hf_models": FOUNDATION,
    "models": FOUNDATION | {"probing", "hf_models"},
    "distributed": FOUNDATION | {"probing", "planning"},
    "estimating": FOUNDATION | {"probing", "models"},
    "configs": FOUNDATION | {"planning"},
    "checking": FOUNDATION | {"probing", "planning", "configs", "models"},
    "training": FOUNDATION | {"planning", "checking"},
    "tuning": FOUNDATION | {"probing", "planning", "models"},
    "pipeline": FOUNDATION | {"probing", "planning", "models", "distributed", "estimating", "configs", "tuning"},
    "lengths": FOUNDATION | {"probing", "planning", "models", "estimating", "configs", "tuning", "pipeline"},
    "answering": FOUNDATION | {"probing", "planning", "models", "distributed", "estimating", "configs", "checking",
                               "tuning", "pipeline", "lengths"},
}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def imported_parts(path: Path) -> set[str]:
    """Top-level parts of autobatch this module imports, lazily or not."""
    rel = list(path.relative_to(ROOT).with_suffix("").parts)
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            else:
                target = (node.module or "").split(".")
            if target[0] == "autobatch" and len(target) > 1:
                found.add(target[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "autobatch" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_module_named_in_the_docs_exists_and_every_module_is_named() -> None:
    tree = DOC.split("```")[1]
    named: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in tree.splitlines()[1:]:
        match = re.match(r"^( *)(\S+)", line)
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([s for _, s in stack] + [name]).replace("//", "/")
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
        else:
            named.add(path)
    actual = {
        str(p.relative_to(ROOT)) for p in modules()
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert named - actual == set(), "docs/architecture.md names modules that do not exist"
    assert actual - named == set(), "modules missing from docs/architecture.md"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_is_small_documented_and_declares_its_names(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 400, f"{path.name} has {len(text.splitlines())} lines; split it by concept"
    tree = ast.parse(text)
    assert ast.get_docstring(tree), "open the module with a docstring saying what it owns"
    if path.name != "__main__.py":
        assert any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
            for n in tree.body
        ), "declare __all__"


@pytest.mark.parametrize("path", [p for p in modules() if p.parent != PACKAGE or p.stem in ALLOWED],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_stage_imports_a_stage_below_it(path: Path) -> None:
    part = part_of(path)
    if part in ("cli", "integrations"):
        assert "cli" not in imported_parts(path) or part == "cli"
        return
    allowed = ALLOWED[part] | {part}
    assert imported_parts(path) <= allowed, f"{part} may import only {sorted(allowed)}"


def test_the_library_never_imports_typer() -> None:
    for path in modules():
        if part_of(path) == "cli":
            continue
        assert "typer" not in path.read_text(), f"{path} mentions typer; keep it in autobatch/cli/"


def test_every_answer_extends_one_result_base() -> None:
    """A field added to BatchResult is a field of the probe, the estimate and the agreed result."""
    import dataclasses

    from autobatch import BatchResult, DistributedProbeResult, Estimate, ProbeResult

    base = {f.name for f in dataclasses.fields(BatchResult)}
    for cls in (ProbeResult, Estimate, DistributedProbeResult):
        assert issubclass(cls, BatchResult)
        assert base <= {f.name for f in dataclasses.fields(cls)}
        assert cls.to_dict is BatchResult.to_dict, f"{cls.__name__} adds its fields through _details()"


def test_the_public_api_is_at_the_top_level() -> None:
    import autobatch

    for name in ("Request", "Report", "answer", "check", "tune_plans", "find", "probe", "solve", "check_setup", "verify_ga", "estimate", "tune", "search_max",
                 "Trial", "Plan", "ProbeResult", "Workload", "deepspeed_config", "hf_training_args"):
        assert name in autobatch.__all__ and getattr(autobatch, name) is not None
    assert callable(autobatch.probe) and callable(autobatch.estimate) and callable(autobatch.find)
    assert all(hasattr(autobatch, name) for name in autobatch.__all__)


def _library_imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every ``from autobatch… import names`` in a CLI module: (the module, the names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level >= 2 or (node.module or "").startswith("autobatch")):
            if node.level >= 2:
                module = node.module or ""
            else:
                module = (node.module or "").removeprefix("autobatch").lstrip(".")
            found.append((module, [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", [p for p in modules() if part_of(p) == "cli"], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_cli_uses_only_the_public_api(path: Path) -> None:
    """The CLI is a thin layer: from the library it takes names in autobatch.__all__, errors and units."""
    import autobatch

    for module, names in _library_imports(path):
        if module in ("errors", "units"):
            continue
        assert module == "", f"{path.name} imports autobatch.{module}; take the name from autobatch.__all__"
        assert set(names) <= set(autobatch.__all__), f"{path.name} imports {sorted(set(names) - set(autobatch.__all__))}"


def test_no_cli_function_is_over_sixty_lines() -> None:
    """A command builds a request and prints a report: the deciding belongs in the library."""
    for path in (p for p in modules() if part_of(p) == "cli"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 60, f"{path.name}:{node.name} is over 60 lines"
