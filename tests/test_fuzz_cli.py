"""Property tests of the command line (hypothesis): every flag's bad values give exit 2 and one line.

Every non-switch flag of every ``plsh`` command is found from the parser itself (a new flag is fuzzed without
being listed here). The command's work function is replaced by one that raises :class:`Accepted`, so a value is
either refused — exit code 2, exactly one line ``plsh <command>: error: ...`` on stderr, and the work never starts —
or accepted. Two properties:

* values that are wrong for every flag of their kind are refused: text where a number is due, ``1.5`` for an
  integer, ``nan`` for a number, ``-1`` for any scalar number (no count, size, seed, rate or bound of any command
  is negative), a word outside a flag's choices, an empty list item;
* any text at all (hypothesis: numbers of every size, ``inf``, empty, unicode, paths) is refused in one line or
  accepted — never a traceback or another exit code.

Only the parsing and the settings' checks run (no model, no data), so each example takes milliseconds.
"""

from __future__ import annotations

import argparse
import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from positional_lsh import cli

# Each command, the fewest arguments it runs with, and the function its ``func`` hands the settings to.
COMMANDS = {
    "demo": ([], "positional_lsh.cli.demo", "run_demo"),
    "bench": (["--lengths", "64"], "positional_lsh.cli.bench", "run_bench_command"),
    "train": (["--out", "{tmp}/run"], "positional_lsh.cli.train", "train"),
    "eval": ([], "positional_lsh.cli.eval", "run_eval"),
    "generate": (["--prompt-file", "{tmp}/prompt.txt"], "positional_lsh.cli.generate", "run_generate"),
    "validate": (["--out", "{tmp}/val"], "positional_lsh.cli.validate", "run_validation"),
    "train-hf": (["--out", "{tmp}/hf", "--preset", "tiny"], "positional_lsh.integrations.hf.train", "train_hf"),
}


class Accepted(Exception):
    """Raised by the replaced work function: the command accepted its flags."""


def _flags(command: str) -> list[argparse.Action]:
    """The non-switch optional flags of ``plsh COMMAND``."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if a.option_strings and a.nargs != 0 and a.type is not None]


ALL = [(c, a.option_strings[0]) for c in COMMANDS for a in _flags(c)]


def _kind(command: str, flag: str) -> tuple[str, tuple | None]:
    """``(kind, choices)`` of a flag from its parser: ``"int"``, ``"float"``, ``"ints"``/``"floats"``/``"names"``
    (comma-separated lists), ``"choice"`` or ``"text"``; found by what it does with probe values."""
    action = next(a for a in _flags(command) if a.option_strings[0] == flag)
    if action.choices is not None:
        return "choice", tuple(action.choices)
    parse = action.type

    def ok(text: str) -> bool:
        try:
            parse(text)
            return True
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            return False

    is_list = ok("none") and parse("none") == ()
    if is_list:
        if ok("2,3") and parse("2,3") == (2, 3) and not ok("2.5"):
            return "ints", None
        if ok("2.5,3") and parse("2.5,3") == (2.5, 3.0):
            return "floats", None
        return "names", None
    if ok("3") and not ok("abc"):
        return ("int" if not ok("2.5") else "float"), None
    return "text", None


def _bad_values(kind: str) -> list[str]:
    return {
        "int": ["abc", "1.5", "", "nan", "-1", "1e3"],
        "float": ["abc", "", "nan", "-1", "1,2"],
        "ints": ["1,x", "1.5", "nan", "-1x"],
        "floats": ["1,x", "nan", "abc"],
        "names": [],
        "choice": ["no-such-choice"],
        "text": [],
    }[kind]


def _run(command: str, extra: list[str], tmp_path, monkeypatch, capsys) -> tuple[int | str, list[str]]:
    """``plsh COMMAND <minimal args> EXTRA`` with the work replaced: ``("accepted", [])`` or (exit code, stderr)."""
    base, module, worker = COMMANDS[command]

    def accept(*args, **kwargs):
        raise Accepted

    monkeypatch.setattr(importlib.import_module(module), worker, accept)
    monkeypatch.delenv("PLSH_DEBUG", raising=False)
    capsys.readouterr()
    argv = [command, *(a.format(tmp=tmp_path) for a in base), *extra]
    try:
        code: int | str = cli.main(argv)
    except Accepted:
        return "accepted", []
    except SystemExit as exc:  # argparse refusals
        code = exc.code if isinstance(exc.code, int) else 2
    return code, capsys.readouterr().err.splitlines()


def _assert_refused(command: str, flag: str, value: str, code, err: list[str]) -> None:
    assert code == 2, f"plsh {command} {flag} {value!r}: exit {code}, stderr {err}"
    assert len(err) == 1 and err[0].startswith(f"plsh {command}: error: "), (command, flag, value, err)


@pytest.mark.parametrize(("command", "flag"), ALL)
def test_bad_values_of_every_flag_are_refused_in_one_line(command, flag, tmp_path, monkeypatch, capsys):
    kind, _ = _kind(command, flag)
    for value in _bad_values(kind):
        code, err = _run(command, [flag, value], tmp_path, monkeypatch, capsys)
        _assert_refused(command, flag, value, code, err)


def test_every_flag_is_fuzzed():
    # Every command is here (a new one needs its entry in COMMANDS), and the table of bad values covers the kinds
    # the parsers produce (a flag of a new kind would show up here).
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    kinds = {(c, f): _kind(c, f)[0] for c, f in ALL}
    assert len(ALL) > 100 and set(kinds.values()) <= {"int", "float", "ints", "floats", "names", "choice", "text"}
    assert kinds[("validate", "--threads")] == "int" and kinds[("validate", "--max-work")] == "float"
    assert kinds[("bench", "--lengths")] == "ints" and kinds[("bench", "--methods")] == "names"


# Any text: numbers of every size and sign, inf/nan, empty, lists, words, paths, unicode.
TEXT = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "none", "all", "inf", "-inf", "1e400", "0", "0.0", ",", "1,,2", "/proc/x", "/", ".",
                     "/nonexistent/dir", "window", "sigma=2", "-5", "2**64", "18446744073709551616"]),
    st.text(max_size=8),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True, database=None)  # fmt: skip
@given(flag=st.sampled_from(ALL), value=TEXT)
def test_any_value_is_refused_in_one_line_or_accepted(flag, value, tmp_path, monkeypatch, capsys):
    command, name = flag
    if value.startswith("-") and not value[1:2].isdigit() and value not in ("-inf",):
        value = " " + value  # argparse would read a leading "-word" as another flag
    code, err = _run(command, [name, value], tmp_path, monkeypatch, capsys)
    if code != "accepted":
        _assert_refused(command, name, value, code, err)
