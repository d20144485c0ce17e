"""Build the distributions and check them the way a user meets them (the release check of .ci/run).

    python scripts/check_release.py [--work DIR] [--keep]

1. ``python -m build``: the sdist, then the wheel built *from the sdist* (so the sdist must hold what a build
   needs);
2. ``twine check --strict`` on both;
3. their contents: the sdist holds the sources, tests, docs, corpus, shipped checkpoint, LICENSE, CHANGELOG and
   ``constraints.txt``; the wheel holds the package, ``py.typed``, corpus and checkpoint, and no tests; both carry
   the version of ``pyproject.toml``;
4. a fresh virtual environment outside the source tree, the wheel installed into it (``pip install -c
   constraints.txt``: dependencies from the package index);
5. from a directory outside the tree, with that environment: ``import positional_lsh`` (from the environment,
   at the version of ``pyproject.toml``), ``plsh --help``, the shipped model's load, and ``plsh demo`` on its
   defaults.

Each step prints its wall time. Work files go to a temporary directory (``--work`` to choose it, ``--keep`` to
keep it). Exit code 0 when every check passes, 1 with the failed check named otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Patterns (fnmatch-like regular expressions on paths inside the archive, after its top folder) of which each must
# match at least one member.
SDIST_REQUIRED = {
    "LICENSE": r"LICENSE",
    "README.md": r"README\.md",
    "CHANGELOG.md": r"CHANGELOG\.md",
    "pyproject.toml": r"pyproject\.toml",
    "constraints.txt": r"constraints\.txt",
    "the package": r"src/positional_lsh/__init__\.py",
    "py.typed": r"src/positional_lsh/py\.typed",
    "the tests": r"tests/test_[a-z_]+\.py",
    "tests/conftest.py": r"tests/conftest\.py",
    "the docs pages": r"docs/design\.md",
    "the docs site": r"docs/conf\.py",
    "the API pages": r"docs/api/index\.rst",
    "the corpus": r"src/positional_lsh/lm/corpus/[^/]+\.jsonl\.xz",
    "the checkpoint's weights": r"src/positional_lsh/lm/checkpoints/[^/]+/model\.safetensors",
    "the checkpoint's config": r"src/positional_lsh/lm/checkpoints/[^/]+/config\.json",
    "the checkpoint's tokenizer": r"src/positional_lsh/lm/checkpoints/[^/]+/tokenizer\.json",
}
WHEEL_REQUIRED = {
    "the package": r"positional_lsh/__init__\.py",
    "py.typed": r"positional_lsh/py\.typed",
    "the command line": r"positional_lsh/cli/__init__\.py",
    "the corpus": r"positional_lsh/lm/corpus/[^/]+\.jsonl\.xz",
    "the checkpoint's weights": r"positional_lsh/lm/checkpoints/[^/]+/model\.safetensors",
    "the checkpoint's config": r"positional_lsh/lm/checkpoints/[^/]+/config\.json",
    "the checkpoint's tokenizer": r"positional_lsh/lm/checkpoints/[^/]+/tokenizer\.json",
    "the license": r"positional_lsh-[^/]+\.dist-info/licenses/LICENSE",
    "the entry point": r"positional_lsh-[^/]+\.dist-info/entry_points\.txt",
}
WHEEL_FORBIDDEN = {"tests": r"tests/.*", "docs": r"docs/.*"}


class CheckFailed(Exception):
    """One check of the release did not hold; the message says which and why."""


def project_version(root: Path = ROOT) -> str:
    """The version in ``pyproject.toml`` (the one source of the version): ``version = "..."`` of ``[project]``."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.M)
    if not match:
        raise CheckFailed("pyproject.toml has no version in [project]")
    return match.group(1)


def sdist_members(path: Path) -> list[str]:
    """The sdist's member paths, without the top folder ``name-version/``."""
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
    return [n.split("/", 1)[1] for n in names if "/" in n]


def wheel_members(path: Path) -> list[str]:
    """The wheel's member paths."""
    with zipfile.ZipFile(path) as whl:
        return [n for n in whl.namelist() if not n.endswith("/")]


def missing(members: Iterable[str], required: dict[str, str]) -> list[str]:
    """The descriptions of the required patterns that no member matches."""
    names = list(members)
    return [what for what, pattern in required.items() if not any(re.fullmatch(pattern, n) for n in names)]


def present(members: Iterable[str], forbidden: dict[str, str]) -> list[str]:
    """The descriptions of the forbidden patterns that some member matches."""
    names = list(members)
    return [what for what, pattern in forbidden.items() if any(re.fullmatch(pattern, n) for n in names)]


def metadata_version(text: str) -> str | None:
    """The ``Version:`` field of core metadata (``PKG-INFO`` / ``METADATA``)."""
    match = re.search(r"^Version: *(\S+)", text, re.M)
    return match.group(1) if match else None


def check_sdist(path: Path, version: str) -> None:
    """The sdist holds every required file and says ``version``."""
    members = sdist_members(path)
    if lacking := missing(members, SDIST_REQUIRED):
        raise CheckFailed(f"the sdist {path.name} lacks {', '.join(lacking)}")
    with tarfile.open(path) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        info = tar.extractfile(f"{top}/PKG-INFO")
        found = metadata_version(info.read().decode()) if info else None
    if found != version:
        raise CheckFailed(f"the sdist's PKG-INFO says version {found}, pyproject.toml says {version}")


def check_wheel(path: Path, version: str) -> None:
    """The wheel holds the package and its data, no tests or docs, and says ``version``."""
    members = wheel_members(path)
    if lacking := missing(members, WHEEL_REQUIRED):
        raise CheckFailed(f"the wheel {path.name} lacks {', '.join(lacking)}")
    if extra := present(members, WHEEL_FORBIDDEN):
        raise CheckFailed(f"the wheel {path.name} holds {', '.join(extra)}")
    meta = next(n for n in members if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(path) as whl:
        found = metadata_version(whl.read(meta).decode())
    if found != version:
        raise CheckFailed(f"the wheel's METADATA says version {found}, pyproject.toml says {version}")


def run(cmd: list[str], *, cwd: Path | None = None, timeout: float = 1800) -> str:
    """Run a command; its output, or :class:`CheckFailed` with the output's tail when it fails."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise CheckFailed(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    return proc.stdout


def timed(step: str, fn: Callable[[], object]) -> object:
    """Run one step, printing its name, its wall time and whether it held."""
    print(f"release check: {step} ...", flush=True)
    start = time.perf_counter()
    result = fn()
    print(f"release check: {step}: ok ({time.perf_counter() - start:.1f} s)", flush=True)
    return result


INSTALLED_CHECK = """
import pathlib, sys
import positional_lsh
root, version = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2]
where = pathlib.Path(positional_lsh.__file__).resolve()
assert root not in where.parents, f"imported from the source tree: {where}"
assert positional_lsh.__version__ == version, (positional_lsh.__version__, version)
print(f"positional_lsh {positional_lsh.__version__} from {where.parent}")
"""
SHIPPED_MODEL_CHECK = """
import torch
from positional_lsh.lm import load_shipped_model
ckpt = load_shipped_model()
ids = torch.tensor([ckpt.tokenizer.encode("It is a truth universally acknowledged, that")])
logits = ckpt.model(ids)
assert logits.shape[:2] == ids.shape and torch.isfinite(logits).all()
print(f"shipped model: {sum(p.numel() for p in ckpt.model.parameters())} parameters, logits {tuple(logits.shape)}")
"""


def check_release(work: Path) -> None:
    """Every step of the module docstring, in ``work`` (which must be outside the source tree)."""
    version = project_version()
    dist, venv, cwd = work / "dist", work / "venv", work / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    timed("build sdist and wheel", lambda: run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)]))
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        raise CheckFailed(f"expected one sdist and one wheel in {dist}, found {[p.name for p in dist.iterdir()]}")
    sdist, wheel = sdists[0], wheels[0]
    for path in (sdist, wheel):
        print(f"  {path.name}: {path.stat().st_size / 2**20:.1f} MiB")
    timed("twine check", lambda: run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)]))
    timed("sdist contents", lambda: check_sdist(sdist, version))
    timed("wheel contents", lambda: check_wheel(wheel, version))
    python = venv / "bin" / "python"
    timed("fresh venv", lambda: run([sys.executable, "-m", "venv", str(venv)]))
    constraints = ["-c", str(ROOT / "constraints.txt")]
    timed("install the wheel", lambda: run([str(python), "-m", "pip", "install", "-q", *constraints, str(wheel)]))
    print("  " + run([str(python), "-c", INSTALLED_CHECK, str(ROOT), version], cwd=cwd).strip())
    plsh = str(venv / "bin" / "plsh")
    timed("plsh --help", lambda: run([plsh, "--help"], cwd=cwd))
    shipped = timed("load the shipped model", lambda: run([str(python), "-c", SHIPPED_MODEL_CHECK], cwd=cwd))
    print("  " + str(shipped).strip())
    demo = timed("plsh demo", lambda: run([plsh, "demo", "--quiet"], cwd=cwd))
    print("  " + str(demo).strip().splitlines()[-1])
    if any(cwd.iterdir()):
        raise CheckFailed(f"plsh wrote files into its working directory: {sorted(p.name for p in cwd.iterdir())}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="work directory outside the source tree (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="plsh-release-"))).resolve()
    if work == ROOT or ROOT in work.parents:
        parser.error(f"--work must be outside the source tree {ROOT}")
    start = time.perf_counter()
    try:
        check_release(work)
    except CheckFailed as exc:
        print(f"release check FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"release check: all passed ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
