"""Packaging: one version, the metadata a package index shows, and the release check's own logic.

The release check itself (``scripts/check_release.py``: build, twine, contents, a fresh install outside the tree)
runs in ``.ci/run`` after the tests; here its archive checks are shown to fail on made-up archives that lack
what a user needs, so that its passing in CI means something.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import re
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import positional_lsh

tomllib = pytest.importorskip("tomllib")  # the standard library from Python 3.11 on

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _release_module():
    if "check_release" not in sys.modules:
        spec = importlib.util.spec_from_file_location("check_release", ROOT / "scripts" / "check_release.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["check_release"] = module
        spec.loader.exec_module(module)
    return sys.modules["check_release"]


SDIST_FILES = [
    "LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "constraints.txt", "PKG-INFO",
    "src/positional_lsh/__init__.py", "src/positional_lsh/py.typed", "tests/test_readme.py", "tests/conftest.py",
    "docs/design.md", "docs/conf.py", "docs/api/index.rst", "src/positional_lsh/lm/corpus/prose.jsonl.xz",
    "src/positional_lsh/lm/checkpoints/alibi-lm/model.safetensors",
    "src/positional_lsh/lm/checkpoints/alibi-lm/config.json",
    "src/positional_lsh/lm/checkpoints/alibi-lm/tokenizer.json",
]  # fmt: skip
WHEEL_FILES = [
    "positional_lsh/__init__.py", "positional_lsh/py.typed", "positional_lsh/cli/__init__.py",
    "positional_lsh/lm/corpus/prose.jsonl.xz", "positional_lsh/lm/checkpoints/alibi-lm/model.safetensors",
    "positional_lsh/lm/checkpoints/alibi-lm/config.json", "positional_lsh/lm/checkpoints/alibi-lm/tokenizer.json",
    "positional_lsh-1.2.3.dist-info/licenses/LICENSE", "positional_lsh-1.2.3.dist-info/entry_points.txt",
    "positional_lsh-1.2.3.dist-info/METADATA",
]  # fmt: skip


def _sdist(tmp_path: Path, files: list[str], version: str = "1.2.3") -> Path:
    path = tmp_path / f"positional_lsh-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            data = f"Metadata-Version: 2.4\nName: positional-lsh\nVersion: {version}\n".encode()
            info = tarfile.TarInfo(f"positional_lsh-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _wheel(tmp_path: Path, files: list[str], version: str = "1.2.3") -> Path:
    path = tmp_path / f"positional_lsh-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name in files:
            whl.writestr(name, f"Metadata-Version: 2.4\nName: positional-lsh\nVersion: {version}\n")
    return path


def test_the_version_has_one_source() -> None:
    """``__version__`` is the installed metadata's, which is ``pyproject.toml``'s; no module writes a version."""
    assert positional_lsh.__version__ == PYPROJECT["project"]["version"]
    assert _release_module().project_version() == PYPROJECT["project"]["version"]
    written = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "src").rglob("*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"\s*__version__\s*(:\s*str\s*)?=\s*[\"']\d+\.\d", line)  # "0+unknown": not installed
    ]
    assert not written, f"a version written by hand: {written}"


def test_the_package_ships_its_type_hints() -> None:
    assert (ROOT / "src" / "positional_lsh" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["positional_lsh"]


def test_the_metadata_says_what_an_index_shows() -> None:
    project = PYPROJECT["project"]
    assert project["keywords"] and "alibi" in project["keywords"]
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")], "the SPDX license field says it (PEP 639)"
    assert project["license"] == "MIT" and (ROOT / "LICENSE").is_file()
    # Only addresses that are known to be true: the paper. The project's own repository address is not known here.
    assert project["urls"] == {"Paper": "https://arxiv.org/abs/2605.09472"}


def test_the_tools_of_ci_come_from_extras() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {extra: {re.split(r"[<>=;\[ ]", dep, maxsplit=1)[0] for dep in deps} for extra, deps in extras.items()}
    assert {"build", "twine", "mypy"} <= names["dev"]
    assert {"sphinx", "myst-parser"} <= names["docs"] <= names["test"]  # the docs tests build the API pages


def test_the_sdist_manifest_covers_a_source_build() -> None:
    manifest = (ROOT / "MANIFEST.in").read_text(encoding="utf-8").split()
    for needed in ("tests", "docs", "CHANGELOG.md", "constraints.txt"):
        assert needed in manifest, f"MANIFEST.in does not include {needed}"


def test_the_type_check_overrides_name_real_modules() -> None:
    """Every module named in ``[tool.mypy]`` overrides exists (a stale exclusion would hide nothing, silently)."""
    for override in PYPROJECT["tool"]["mypy"].get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        for name in modules:
            if name.startswith("positional_lsh"):
                assert importlib.util.find_spec(name.removesuffix(".*")) is not None, f"no module {name}"


def test_a_complete_sdist_and_wheel_pass(tmp_path: Path) -> None:
    release = _release_module()
    release.check_sdist(_sdist(tmp_path, SDIST_FILES), "1.2.3")
    release.check_wheel(_wheel(tmp_path, WHEEL_FILES), "1.2.3")


@pytest.mark.parametrize(
    "dropped, named",
    [
        ("LICENSE", "LICENSE"),
        ("tests/test_readme.py", "the tests"),
        ("docs/design.md", "the docs pages"),
        ("src/positional_lsh/lm/corpus/prose.jsonl.xz", "the corpus"),
        ("src/positional_lsh/lm/checkpoints/alibi-lm/model.safetensors", "the checkpoint's weights"),
        ("CHANGELOG.md", "CHANGELOG.md"),
    ],
)
def test_an_sdist_without_what_a_build_needs_fails(tmp_path: Path, dropped: str, named: str) -> None:
    release = _release_module()
    files = [f for f in SDIST_FILES if f != dropped]
    with pytest.raises(release.CheckFailed, match=f"lacks {re.escape(named)}"):
        release.check_sdist(_sdist(tmp_path, files), "1.2.3")


def test_a_wheel_without_its_data_or_with_the_tests_fails(tmp_path: Path) -> None:
    release = _release_module()
    with pytest.raises(release.CheckFailed, match=re.escape("lacks py.typed")):
        release.check_wheel(_wheel(tmp_path, [f for f in WHEEL_FILES if "py.typed" not in f]), "1.2.3")
    with pytest.raises(release.CheckFailed, match="holds tests"):
        release.check_wheel(_wheel(tmp_path, [*WHEEL_FILES, "tests/test_readme.py"]), "1.2.3")


def test_a_version_mismatch_fails(tmp_path: Path) -> None:
    release = _release_module()
    with pytest.raises(release.CheckFailed, match=re.escape("version 1.2.3, pyproject.toml says 9.9.9")):
        release.check_sdist(_sdist(tmp_path, SDIST_FILES), "9.9.9")
    with pytest.raises(release.CheckFailed, match=re.escape("version 1.2.3, pyproject.toml says 9.9.9")):
        release.check_wheel(_wheel(tmp_path, WHEEL_FILES), "9.9.9")


def test_the_release_check_refuses_a_work_directory_inside_the_tree() -> None:
    with pytest.raises(SystemExit) as exc:
        _release_module().main(["--work", str(ROOT / "build" / "release")])
    assert exc.value.code == 2
