"""Command-line parsers generated from dataclasses: every ``plsh`` command's settings are written once.

A command's settings are a dataclass; each field that is a command-line option carries a :class:`Flag` in its
metadata (written with :func:`option`): the help text, and where the field's name and type do not say it, the
flag's name, a parser for its text and its choices. :func:`add_arguments` turns the dataclass into argparse
arguments (the default, in the help, is the dataclass's), :func:`values_from_args` and :func:`config_from_args`
turn the parsed namespace back into field values or an instance, :func:`run_command` runs a command on its
settings, and :func:`to_argv` writes the flags that reproduce an instance. Dataclasses owned elsewhere
(``ModelConfig``) get their flags from a mapping ``{field name: Flag}`` passed as ``flags=``.

Conventions:

* a ``bool`` field is a switch that sets the field to ``not default`` (``progress: bool = True`` with flag
  ``--quiet`` or ``--no-progress``);
* ``tuple[X, ...]`` fields are comma-separated lists (:func:`comma_list`);
* ``X | None`` fields parse as ``X``;
* ``none=`` names the word that means ``None`` (``--layers all``); ``"none"`` or ``""`` means an empty list.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from positional_lsh.ops.checks import positive_int

__all__ = [
    "Flag",
    "add_arguments",
    "add_parser_command",
    "comma_list",
    "config_from_args",
    "float_text",
    "int_text",
    "option",
    "positive_float_text",
    "positive_int_text",
    "run_command",
    "seed_text",
    "sigma_text",
    "to_argv",
    "values_from_args",
]

_META = "cli"


@dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line.

    Attributes:
        help: the help text (the default is appended from the dataclass).
        name: the flag (default ``--`` + the field name with ``-`` for ``_``); ``positional=True``: a positional.
        parse: text -> value (default: from the field's type).
        choices: allowed values (argparse ``choices``; for lists, checked per item).
        none: the word that parses to ``None`` (e.g. ``"all"``).
        group: argument group title (``None``: the parser itself).
        dest: the namespace attribute (default: the field name).
        positional: a positional argument taking any number of values (``nargs="*"``).
        show_default: append the dataclass default to the help.
    """

    help: str
    name: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    none: str | None = None
    group: str | None = None
    dest: str | None = None
    positional: bool = False
    show_default: bool = True


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    **flag: Any,
) -> Any:
    """A dataclass field with its command-line flag; ``flag`` holds :class:`Flag`'s other attributes.

    Without ``default`` the field (and the flag) is required.
    """
    meta = {_META: Flag(help=help, **flag)}
    if isinstance(default, list | dict | set):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------------
# Parsers of flag text
# --------------------------------------------------------------------------------------------------


def int_text(text: str) -> int:
    """``"3"`` -> ``3``; anything that is not an integer raises ``ValueError`` ("expected an integer")."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def float_text(text: str) -> float:
    """``"0.5"`` -> ``0.5``; anything that is not a number raises ``ValueError``. ``nan`` is refused (no setting
    means "not a number"); ``inf`` parses, and each setting says whether it takes it."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise ValueError(f"expected a number, got {text!r}")
    return value


def positive_int_text(text: str) -> int:
    """``"3"`` -> ``3``; anything that is not an integer ``>= 1`` raises ``ValueError``."""
    return positive_int("value", int_text(text))


SEED_LIMIT = 2**63
"""Seeds are ints in ``[0, 2**63)``: every seed of the package ends up in a ``torch.Generator`` or an int64."""


def seed_text(text: str) -> int:
    """``"3"`` -> ``3``; anything that is not an integer in ``[0, 2**63)`` raises ``ValueError`` (every ``*seed``
    flag parses with it: a larger seed would overflow torch's int64 seeds deep inside a run)."""
    value = int_text(text)
    if not 0 <= value < SEED_LIMIT:
        raise ValueError(f"a seed must be an integer in [0, 2^63), got {text!r}")
    return value


MIN_SIGMA = 1e-30
"""The smallest ``--sigma``: its slope ``1/sigma`` (times a distance) must stay finite in float32 attention."""


def sigma_text(text: str) -> float:
    """``"16"`` -> ``16.0``; anything outside ``[1e-30, inf]`` raises ``ValueError`` naming ``--sigma`` and the range
    (every ``sigma`` flag parses with it; ``inf`` is slope 0: no decay)."""
    value = float_text(text)
    if not MIN_SIGMA <= value <= math.inf:
        raise ValueError(f"--sigma must be a number in [{MIN_SIGMA:g}, inf] (the slope 1/sigma must stay finite in "
                         f"float32 attention), got {text!r}")  # fmt: skip
    return value


def positive_float_text(text: str) -> float:
    """``"0.5"`` -> ``0.5``; anything that is not a finite number ``> 0`` raises ``ValueError``."""
    value = float_text(text)
    if not 0 < value < math.inf:
        raise ValueError(f"value must be a finite number > 0, got {text!r}")
    return value


def _friendly(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type`` whose errors are one clear message (argparse would otherwise say
    ``invalid <function name> value``): its own ``ArgumentTypeError``, else ``invalid value 'TEXT': <reason>``."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            message = reason if repr(text) in reason else f"invalid value {text!r}: {reason}"
            raise argparse.ArgumentTypeError(message) from None

    convert.__name__ = name
    return convert


_ITEM_WORDS = {int: "integers", float: "numbers", str: "names", positive_int_text: "positive integers",
               positive_float_text: "positive numbers", int_text: "integers", float_text: "numbers"}  # fmt: skip
_ITEM_PARSERS: dict[Any, Callable[[str], Any]] = {int: int_text, float: float_text}


def comma_list(
    item: Callable[[str], Any] = str, *, choices: Sequence[Any] | None = None, none: str | None = None
) -> Callable[[str], tuple[Any, ...] | None]:
    """An argparse ``type``: ``"1,2,4"`` -> ``(1, 2, 4)`` with ``item`` parsing each element.

    ``"none"`` or ``""`` gives ``()``; the word ``none`` (e.g. ``"all"``) gives ``None``. Bad items raise
    ``argparse.ArgumentTypeError`` ("expected comma-separated ...").
    """
    what = _ITEM_WORDS.get(item, "values")
    item = _ITEM_PARSERS.get(item, item)

    def parse(text: str) -> tuple[Any, ...] | None:
        if none is not None and text.strip() == none:
            return None
        if text.strip() in ("", "none"):
            return ()
        try:
            out = tuple(item(x.strip()) for x in text.split(",") if x.strip())
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r} ({exc})") from None
        bad = [x for x in out if choices is not None and x not in choices]
        if bad:
            allowed = tuple(choices or ())
            raise argparse.ArgumentTypeError(f"expected comma-separated values from {allowed}, got {text!r}")
        return out

    parse.__name__ = f"comma-separated {what}"  # argparse names the type in its messages
    return parse


# --------------------------------------------------------------------------------------------------
# Dataclass -> argparse
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    field: dataclasses.Field[Any]
    flag: Flag
    kind: Any  # the field's type without None

    @property
    def dest(self) -> str:
        return self.flag.dest or self.field.name

    @property
    def name(self) -> str:
        return self.flag.name or "--" + self.field.name.replace("_", "-")

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return dataclasses.MISSING

    @property
    def is_switch(self) -> bool:
        return self.kind is bool

    def parser(self) -> Callable[[str], Any]:
        if self.flag.parse is not None:
            return self.flag.parse
        origin, args = typing.get_origin(self.kind), typing.get_args(self.kind)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float, str):
            return comma_list(args[0], choices=self.flag.choices, none=self.flag.none)
        if self.kind is int and (self.field.name == "seed" or self.field.name.endswith("_seed")):
            return seed_text
        if self.kind is float and self.field.name == "sigma":
            return sigma_text
        if self.kind in (int, float, str):
            return _ITEM_PARSERS.get(self.kind, self.kind)
        raise TypeError(f"field {self.field.name}: give Flag.parse for type {self.kind}")

    def text(self, value: Any) -> str:
        """The flag text that parses back to ``value``."""
        if value is None:
            return self.flag.none or ""
        if isinstance(value, tuple | list):
            return ",".join(map(str, value)) if value else "none"
        return str(value)


def _specs(cls: type, flags: Mapping[str, Flag] | None) -> list[_Spec]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(flags) if flags is not None else [n for n, f in fields.items() if _META in f.metadata]
    out = []
    for name in names:
        f = fields[name]
        flag = flags[name] if flags is not None else f.metadata[_META]
        kind = hints[name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = rest[0] if len(rest) == 1 else kind
        out.append(_Spec(f, flag, kind))
    return out


def _help(spec: _Spec) -> str:
    text = spec.flag.help
    default = spec.default
    if (
        spec.flag.show_default
        and not spec.is_switch
        and default is not dataclasses.MISSING
        and (default is not None or spec.flag.none)
    ):
        text = f"{text} (default: {spec.text(default) or repr('')})" if text else f"default: {spec.text(default)}"
    return text.replace("%", "%%")


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    flags: Mapping[str, Flag] | None = None,
    groups: dict[str, argparse._ArgumentGroup] | None = None,
    none_defaults: bool = False,
) -> None:
    """Add one argument per flagged field of dataclass ``cls`` (or per entry of ``flags``, in its order).

    Args:
        parser: where the arguments go.
        cls: the dataclass.
        flags: ``{field name: Flag}`` for a dataclass whose fields carry no :class:`Flag` (owned elsewhere).
        groups: argument groups by title, created on first use (pass one dict to several calls to share them).
        none_defaults: argparse defaults are ``None`` (the help still shows the dataclass's), so that the caller
            can tell which flags were given (presets fill in the rest).
    """
    groups = {} if groups is None else groups
    for spec in _specs(cls, flags):
        target: Any = parser
        if spec.flag.group is not None:
            if spec.flag.group not in groups:
                groups[spec.flag.group] = parser.add_argument_group(spec.flag.group)
            target = groups[spec.flag.group]
        default = None if none_defaults or spec.default is dataclasses.MISSING else spec.default
        kw: dict[str, Any] = {"help": _help(spec), "default": default}
        if spec.flag.positional:
            item = spec.flag.parse or (typing.get_args(spec.kind) or (str,))[0]
            target.add_argument(spec.dest, nargs="*", type=_friendly(item, spec.dest), **kw)
            continue
        kw["dest"] = spec.dest
        if spec.is_switch:
            target.add_argument(spec.name, action="store_const", const=not spec.default, **kw)
            continue
        if spec.default is dataclasses.MISSING:
            kw["required"] = True
        kw["metavar"] = spec.name.lstrip("-").replace("-", "_").upper()
        if spec.flag.choices is not None and typing.get_origin(spec.kind) is not tuple:
            kw["choices"] = spec.flag.choices
            kw["metavar"] = "{" + ",".join(map(str, spec.flag.choices)) + "}"
        target.add_argument(spec.name, type=_friendly(spec.parser(), spec.name), **kw)


def values_from_args(
    args: argparse.Namespace, cls: type, *, flags: Mapping[str, Flag] | None = None, given_only: bool = False
) -> dict[str, Any]:
    """``{field name: value}`` of ``cls``'s flagged fields in ``args`` (``given_only``: only those not ``None``)."""
    out = {}
    for spec in _specs(cls, flags):
        value = getattr(args, spec.dest)
        if given_only and value is None:
            continue
        out[spec.field.name] = tuple(value) if spec.flag.positional else value
    return out


def config_from_args(args: argparse.Namespace, cls: type, **overrides: Any) -> Any:
    """An instance of dataclass ``cls`` from its flags in ``args``; ``overrides`` set other fields."""
    return cls(**{**values_from_args(args, cls), **overrides})


def run_command(args: argparse.Namespace, cls: type, run: Callable[[Any], object]) -> int:
    """A ``plsh`` command's ``func``: ``run`` the ``cls`` settings read from ``args``; return 0.

    Nothing is caught here: a setting ``cls`` refuses (``ValueError``/``TypeError``) or an error of ``run``
    propagates to :func:`positional_lsh.cli.guarded`, which runs every command and turns a user's mistake into
    one line on stderr and exit code 2.
    """
    run(config_from_args(args, cls))
    return 0


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    cls: type,
    run: Callable[[Any], object],
    *,
    help: str,
    doc: str | None = None,
) -> argparse.ArgumentParser:
    """Add the command ``plsh name``: one flag per flagged field of dataclass ``cls``, then ``run`` on the settings
    (:func:`run_command`). ``doc``: the command module's docstring, whose first paragraph is the description."""
    p = sub.add_parser(name, help=help, description=description(doc))
    add_arguments(p, cls)
    p.set_defaults(func=functools.partial(run_command, cls=cls, run=run))
    return p


def description(doc: str | None) -> str | None:
    """A command's ``--help`` description: the first paragraph of its module's docstring ``doc``."""
    return doc.split("\n\n")[0] if doc else None


def add_parser_command(
    sub: argparse._SubParsersAction,
    name: str,
    add: Callable[[argparse.ArgumentParser], None],
    func: Callable[[argparse.Namespace], int],
    *,
    help: str,
    doc: str | None,
) -> argparse.ArgumentParser:
    """Add the command ``plsh name`` whose flags ``add(parser)`` adds and that runs ``func(args)`` (for commands
    that take more than one settings dataclass, where :func:`add_command` does not fit); ``doc`` as
    :func:`add_command`'s."""
    p = sub.add_parser(name, help=help, description=description(doc))
    add(p)
    p.set_defaults(func=func)
    return p


def to_argv(cfg: Any, *, skip: Iterable[str] = ()) -> list[str]:
    """The flags that rebuild ``cfg`` through its parser: required fields, then those not at their default."""
    out: list[str] = []
    positionals: list[str] = []
    skip = set(skip)
    for spec in _specs(type(cfg), None):
        value = getattr(cfg, spec.field.name)
        if spec.field.name in skip or (spec.default is not dataclasses.MISSING and value == spec.default):
            continue
        if spec.flag.positional:
            positionals += [spec.text(v) for v in value]
        elif spec.is_switch:
            out.append(spec.name)
        else:
            out += [spec.name, spec.text(value)]
    return out + positionals
