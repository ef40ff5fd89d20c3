"""gpuwarden.ckpt's public API (issue 35): `__all__` resolves, `import gpuwarden.ckpt` stays
light, and the job kit's examples and the docs import only public names."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuwarden.ckpt

REPO = Path(__file__).resolve().parents[2]
CKPT = REPO / "gpuwarden" / "ckpt"
ADAPTERS = ("dcp", "nested")  # the public modules besides the package (its docstring)
_PY_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _declared_all(path: Path) -> list[str] | None:
    """A module's literal ``__all__``, read without importing it (dcp imports torch)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return value
    return None


def _public() -> dict[str, set[str]]:
    """Each public module and the names it declares."""
    public = {"gpuwarden.ckpt": set(gpuwarden.ckpt.__all__)}
    for name in ADAPTERS:
        declared = _declared_all(CKPT / f"{name}.py")
        assert declared is not None, f"gpuwarden.ckpt.{name} declares no __all__"
        public[f"gpuwarden.ckpt.{name}"] = set(declared)
    return public


def _sources() -> list[tuple[str, str]]:
    """The job kit's scripts, and every python block of the docs, README and the kit's README."""
    found = [(str(p.relative_to(REPO)), p.read_text())
             for p in sorted((REPO / "gpuwarden" / "sitefiles").rglob("*.py"))
             if p.name != "gpuwarden_pystart.py"]  # the hooks' start: the next test
    docs = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
            *sorted((REPO / "gpuwarden" / "sitefiles").rglob("*.md"))]
    for doc in docs:
        text = doc.read_text()
        for i, m in enumerate(_PY_BLOCK.finditer(text)):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{doc.relative_to(REPO)}:{line} (block {i + 1})", m.group(1)))
    return found


def _private_imports(where: str, source: str, public: dict[str, set[str]]) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [f"{where}: not valid Python ({exc})"]
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [f"{where}: import {a.name}" for a in node.names
                    if a.name.startswith("gpuwarden.") and a.name not in public]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            mod = node.module
            if mod.startswith("gpuwarden.") and not (mod == "gpuwarden.ckpt"
                                                    or mod.startswith("gpuwarden.ckpt.")):
                bad += [f"{where}: from {mod} import {a.name}" for a in node.names]
                continue  # the job kit has one public API: gpuwarden.ckpt's
            if mod == "gpuwarden":
                continue  # `from gpuwarden import ckpt`: the package itself
            if mod == "gpuwarden.ckpt":
                bad += [f"{where}: from gpuwarden.ckpt import {a.name}" for a in node.names
                        if a.name not in public[mod] and f"{mod}.{a.name}" not in public]
            elif mod.startswith("gpuwarden.ckpt."):
                names = public.get(mod)
                bad += [f"{where}: from {mod} import {a.name}" for a in node.names
                        if names is None or a.name not in names]
    return bad


def test_the_examples_and_docs_import_only_the_public_api() -> None:
    public = _public()
    sources = _sources()
    assert any(w.endswith("train_example.py") for w, _ in sources)
    assert any(w.startswith("docs/checkpointing.md") for w, _ in sources)
    bad = [b for where, src in sources for b in _private_imports(where, src, public)]
    assert not bad, "\n".join(bad)


def test_the_hooks_start_imports_only_the_hooks_entry_point() -> None:
    """gpuwarden_pystart.py is copied next to the hooks and imports the package as root; the
    package's own modules import it for the hooks' rule. It reaches the package at one name
    (import-linter does not see sitefiles/, which is data, not a package)."""
    start = REPO / "gpuwarden" / "sitefiles" / "prolog" / "gpuwarden_pystart.py"
    found = set()
    for node in ast.walk(ast.parse(start.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpuwarden"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gpuwarden")}
    assert found == {"gpuwarden.hooks.run"}
    # A site that upgraded the wheel but not the copied-out start still gets the entry point.
    from gpuwarden.health.hooks import main as old_name
    from gpuwarden.hooks.run import main
    assert old_name is main


def test_the_check_catches_a_private_import() -> None:
    public = _public()
    src = ("from gpuwarden.ckpt.job import JobCheckpointer\nimport gpuwarden.ckpt.fstier\n"
           "from gpuwarden.ckpt import fstier, JobCheckpointer, dcp\n"
           "from gpuwarden.ckpt.dcp import dcp_writer, ITEMS\n"
           "from gpuwarden.slurm.hostlist import expand\n")
    assert _private_imports("x", src, public) == [
        "x: from gpuwarden.ckpt.job import JobCheckpointer",
        "x: import gpuwarden.ckpt.fstier",
        "x: from gpuwarden.ckpt import fstier",
        "x: from gpuwarden.ckpt.dcp import ITEMS",
        "x: from gpuwarden.slurm.hostlist import expand",
    ]


def test_every_public_name_resolves_to_its_module_s_own_object() -> None:
    assert set(gpuwarden.ckpt.__all__) == set(gpuwarden.ckpt._HOME)
    assert len(gpuwarden.ckpt.__all__) == len(set(gpuwarden.ckpt.__all__))
    for name in gpuwarden.ckpt.__all__:
        module, _, attr = gpuwarden.ckpt._HOME[name].partition(":")
        home = importlib.import_module(module if attr else f"gpuwarden.ckpt.{module}")
        assert getattr(gpuwarden.ckpt, name) is getattr(home, attr or name), name
    assert set(gpuwarden.ckpt.__all__) <= set(dir(gpuwarden.ckpt))
    with pytest.raises(AttributeError, match="no attribute 'fsTier'"):
        _ = gpuwarden.ckpt.fsTier


def test_the_adapters_names_resolve() -> None:
    nested = importlib.import_module("gpuwarden.ckpt.nested")
    for name in nested.__all__:
        assert hasattr(nested, name), name
    pytest.importorskip("torch")
    dcp = importlib.import_module("gpuwarden.ckpt.dcp")
    for name in dcp.__all__:
        assert hasattr(dcp, name), name
    assert set(_declared_all(CKPT / "dcp.py") or ()) == set(dcp.__all__)


def test_the_tier_errors_are_defined_once() -> None:
    """One class each, in ckpt.tier: every tier and restore catch the same ones."""
    shared = {"TierError", "TierFull", "CorruptStep", "Tier"}
    where = {(p.name, n.name) for p in CKPT.glob("*.py")
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.ClassDef) and n.name in shared}
    assert where == {("tier.py", n) for n in shared}


def test_importing_the_package_imports_nothing_heavy() -> None:
    code = ("import sys, gpuwarden.ckpt\n"
            "print(sorted(m for m in sys.modules if m.startswith('gpuwarden.ckpt.')\n"
            "      or m.split('.')[0] in ('numpy', 'xxhash', 'torch', 'boto3')))\n"
            "from gpuwarden.ckpt import EXIT_REQUEUE, JobCheckpointer, TierFull, checksum\n"
            "print(sorted(m for m in ('torch', 'boto3') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert res.stdout.splitlines() == ["[]", "[]"], res.stdout + res.stderr
