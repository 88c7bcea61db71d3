"""Imports point down only: tracer (the recorded step) < strategies (one rank's
step) < analysis (passes, outputs, planning, the CLI).

Read from the source with `ast`, so a lazy import inside a function counts too.
`tracer/__main__.py` is the one exemption: it keeps `python -m tracer` as the
command and only hands over to `analysis.cli`.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("tracer", "strategies", "analysis")
EXEMPT = {Path("tracer/__main__.py")}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(LAYERS)


def _modules(package: str) -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", LAYERS)
def test_no_module_imports_from_a_higher_layer(package):
    level = LAYERS.index(package)
    higher = set(LAYERS[level + 1 :])
    offenders = {
        str(path): sorted(_imported_packages(ROOT / path) & higher)
        for path in _modules(package)
        if path not in EXEMPT and _imported_packages(ROOT / path) & higher
    }
    assert not offenders, f"imports from a higher layer: {offenders}"


def test_the_check_reads_real_modules():
    """Guard against a vacuous pass: each layer has modules and analysis imports both below."""
    for package in LAYERS:
        assert _modules(package)
    below = set().union(*(_imported_packages(ROOT / p) for p in _modules("analysis")))
    assert {"tracer", "strategies"} <= below
