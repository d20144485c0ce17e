"""The house rules of docs/architecture.md: import direction between rooms, a light ``import positional_lsh``,
self-contained documentation."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "positional_lsh"

# (room, rooms it must not import, also not inside functions?): the rules of docs/architecture.md. Room names are
# relative to positional_lsh; "hf" and "model" are the alias modules that load integrations.hf and lm.
RULES = [
    ("ops", ("theory", "lm", "integrations", "cli", "distributed", "hf", "model"), True),
    ("theory", ("lm", "integrations", "cli", "hf", "model"), False),
    ("lm", ("theory", "integrations", "cli", "hf"), False),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _lazy_names() -> dict[str, str]:
    """Names the top-level package serves lazily (``positional_lsh._LAZY``), read without importing it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every import statement of a source file."""
    return _imports_in(path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py")


def _imports_in(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    package = module if is_package else module.rpartition(".")[0]
    lazy = _lazy_names()
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    # ``from pkg import x``: x is a submodule or a name in pkg; either way it is under pkg
                    name = (
                        lazy[alias.name] if base == "positional_lsh" and alias.name in lazy else f"{base}.{alias.name}"
                    )
                    found.append((name, child.lineno, in_function))
            visit(
                child,
                in_function
                or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                or _is_main_guard(child),
            )

    visit(ast.parse(source), False)
    return found


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` — code that runs only when the module is the program, like a function."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    left, right = node.test.left, node.test.comparators[0]
    return isinstance(left, ast.Name) and left.id == "__name__" and getattr(right, "value", None) == "__main__"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_rooms_import_only_downwards() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for room, forbidden, also_in_functions in RULES:
            if not _under(module, f"positional_lsh.{room}"):
                continue
            for name, line, in_function in _imports(path):
                if in_function and not also_in_functions:
                    continue
                if any(_under(name, f"positional_lsh.{f}") for f in forbidden):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({room} must not)")
    assert not offenders, "imports against docs/architecture.md:\n" + "\n".join(offenders)


def test_the_import_parser_sees_function_level_and_relative_imports() -> None:
    source = (
        "import os\nfrom . import sibling\n\ndef f():\n    from positional_lsh import TransformerLM\n"
        "if __name__ == '__main__':\n    import positional_lsh.cli\n"
    )
    found = _imports_in(source, "positional_lsh.ops.probe", is_package=False)
    assert found == [
        ("os", 1, False),
        ("positional_lsh.ops.sibling", 2, False),
        ("positional_lsh.lm", 5, True),
        ("positional_lsh.cli", 7, True),
    ]


def test_import_positional_lsh_loads_only_the_op_layer() -> None:
    code = (
        "import sys, positional_lsh\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith('positional_lsh') "
        "and m != 'positional_lsh' and not m.startswith('positional_lsh.ops')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "", f"import positional_lsh also loaded: {out.stdout.split()}"


def test_documentation_is_self_contained() -> None:
    missing = "DESIGN" + ".md"  # a design file that is not part of this repository (spelled so as not to match here)
    suffixes = {".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".yaml", ".yml"}
    files = [ROOT / "README.md"] + [
        p
        for d in ("src", "docs", "tests")
        for p in sorted((ROOT / d).rglob("*"))
        if p.is_file() and p.suffix in suffixes
    ]
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if missing in line
    ]
    assert not hits, f"{missing} is not in this repository; point to docs/design.md instead: {hits}"
    assert (ROOT / "docs" / "design.md").is_file() and (ROOT / "docs" / "architecture.md").is_file()


@pytest.mark.parametrize("doc", ["design.md", "architecture.md"])
def test_docs_name_modules_that_exist(doc: str) -> None:
    """Every dotted ``positional_lsh.x.y`` named in the design and architecture pages can be imported
    (the last component may be an attribute of its module)."""
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    missing = []
    for name in sorted(set(re.findall(r"positional_lsh(?:\.[A-Za-z_]+)+", text))):
        parent, _, last = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ImportError:
            try:
                if not hasattr(importlib.import_module(parent), last):
                    missing.append(name)
            except ImportError:
                missing.append(name)
    assert not missing, f"docs/{doc} names modules that do not exist: {missing}"
