"""The ``>>>`` examples in the package's docstrings run, and the main entry points have them.

Every docstring example of every module of the package (``cli/__main__`` aside: importing it runs the command) is
collected with :mod:`doctest` and run here, one test per module, so an example that stops matching the code fails
the suite. The five entry points that the README and the API reference lead with must carry an example.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import positional_lsh

ENTRY_POINTS = {
    "positional_lsh.ops.attention": ["plsh_attention"],
    "positional_lsh.ops.module": ["PositionalLSHAttention"],
    "positional_lsh.ops.exact.alibi": ["alibi_attention"],
    "positional_lsh.ops.partitions.partition": ["sample_partitions"],
    "positional_lsh.integrations.hf.swap": ["use_positional_lsh"],
}
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    names = ["positional_lsh"]
    names += [m.name for m in pkgutil.walk_packages(positional_lsh.__path__, "positional_lsh.")]
    return [n for n in names if not n.endswith("__main__")]


def _examples(module_name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(module_name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, module_name)
    return sorted((t for t in tests if t.examples), key=lambda t: t.name)


def _run(tests: list[doctest.DocTest]) -> tuple[doctest.TestResults, str]:
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for test in tests:
        runner.run(test, out=report.append)
    return runner.summarize(verbose=False), "".join(report)


MODULES_WITH_EXAMPLES = [m for m in _modules() if _examples(m)]


@pytest.mark.parametrize("module_name", MODULES_WITH_EXAMPLES)
def test_docstring_examples_pass(module_name: str) -> None:
    results, report = _run(_examples(module_name))
    assert results.attempted > 0
    assert results.failed == 0, f"docstring examples of {module_name} fail:\n{report}"


@pytest.mark.parametrize("module_name, name", [(m, n) for m, names in ENTRY_POINTS.items() for n in names])
def test_entry_point_has_an_example(module_name: str, name: str) -> None:
    names = {t.name for t in _examples(module_name)}
    assert f"{module_name}.{name}" in names, f"{module_name}.{name} has no >>> example in its docstring"


def test_a_wrong_example_fails() -> None:
    """The runner used above does report a mismatch (so a passing run means the examples hold)."""

    def wrong() -> None:
        """
        >>> 1 + 1
        3
        """

    tests = doctest.DocTestFinder().find(wrong, "wrong", globs={})
    results, report = _run(tests)
    assert results.attempted == 1 and results.failed == 1
    assert "Expected:\n    3\nGot:\n    2" in report
