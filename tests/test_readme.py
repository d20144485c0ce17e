"""The README's Quickstart and .ci/run must not drift apart, and the README's examples must run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "the Quickstart has a code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_quickstart_has_exactly_two_commands():
    commands = _quickstart_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("plsh demo")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = _quickstart_commands()[1]
    # .ci/run creates and activates the virtual environment itself, then runs the rest verbatim.
    tail = test_command.split(". .venv/bin/activate && ", 1)[1]
    assert tail in ci, f".ci/run must run {tail!r}"
    assert "constraints.txt" in tail  # torch pinned to the CPU wheel


def _development_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Development\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the Development section has a code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _ci_steps() -> list[str]:
    ci = (ROOT / ".ci" / "run").read_text()
    return [line.removeprefix("step ").strip() for line in ci.splitlines() if line.startswith("step ")]


def test_ci_runs_the_development_steps_after_the_tests():
    """The release checks of .ci/run are the README's Development commands, in order, after the test command."""
    steps = _ci_steps()
    assert steps, ".ci/run runs no release-check step"
    assert steps == _development_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    tail = _quickstart_commands()[1].split(". .venv/bin/activate && ", 1)[1]
    assert ci.index(tail) < ci.index("step " + steps[0]), "the README's test command runs first"
    assert "-c constraints.txt" in steps[0] and ".[test,dev]" in steps[0]  # the tools come from an extra


def test_every_development_step_is_explained():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Development\n", 1)[1].split("\n## ", 1)[0]
    explained = re.findall(r"^\d+\. `([^`]+)`", section, re.M)
    assert explained == _development_commands()


def test_readme_python_examples_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for code in blocks:
        if "# not run in tests" in code:
            continue
        exec(compile(code, "README.md", "exec"), {})
