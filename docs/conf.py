"""Sphinx configuration of the documentation site: the pages of docs/*.md and an API reference from the docstrings.

Build (warnings are errors, nothing is downloaded)::

    python -m sphinx -W --keep-going -n -E -b html docs build/docs

**A module's ``__all__`` is its public API.** A module whose contents are internal to its room (plumbing that other
modules of the package import: run directories, the step loop, a family's replacement forward, ...) declares no
``__all__``; its names stay importable under their public names, but the site does not render it. So the API
pages (``docs/api/*.rst``) hold one ``.. api-module:: ROOM`` directive each; it renders the room's package and every
module below it that is public (no ``_``-prefixed component, no ``__main__``) and declares a non-empty ``__all__``
(packages too; :data:`PUBLIC_MODULES`). Every name of such a module's ``__all__`` is rendered with its signature:
in full once, at its *home* (the module that defines it, when that module lists it; otherwise the first rendered
module that lists it), and as a one-line entry pointing there in every other module that lists it. All of these
names resolve as cross-reference targets (the other names are aliases of the home). A reference to a name of the
package that is not rendered leads to where its object is rendered, or else is shown as text (an internal name);
one to a name that does not exist is an error. A module, class or function rendered without a docstring, a
reference that resolves nowhere, and a docstring that is not valid reStructuredText are build errors.
``tests/test_docs_site.py`` compares what is rendered with each ``__all__``, and keeps the public API small: at
most 250 objects rendered in full.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import math
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.domains.python import ObjectEntry
from sphinx.environment import BuildEnvironment
from sphinx.ext.napoleon import docstring as napoleon_docstring
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode, nested_parse_with_titles

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import positional_lsh  # noqa: E402  (after the path is set, so a source checkout documents itself)

logger = logging.getLogger("positional_lsh.docs")

project = "positional-lsh"
author = "positional-lsh developers"
copyright = "2026, positional-lsh developers"
release = positional_lsh.__version__
version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# furo: a theme made for reading code and API pages (wide content column, code blocks that fit at 1280 px).
html_theme = "furo"
html_title = "positional-lsh"
html_static_path = ["_static"]
html_css_files = ["wide-code.css"]  # a content column wide enough for 120-character code lines at 1280 px
html_show_sourcelink = False

myst_heading_anchors = 4

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # torch's docstrings (Function.forward, NamedTuple) are not this library's
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields: dataclass fields are rendered as members already

# Broken cross-references are errors (``-n``). Other libraries have no inventory here (nothing is downloaded), so
# references into them are not checked; nor are references to private names and to the command line's modules
# (the reference covers the library; ``plsh <command> --help`` and the README cover the command line).
nitpicky = True
EXTERNAL = (
    r"(torch|nn|np|numpy|scipy|transformers|tokenizers|safetensors|matplotlib|datasets|triton|tl|argparse|ctx"
    r"|collections|typing|types|enum|dataclasses|pathlib|os|concurrent|contextlib|signal|threading)"
)
nitpick_ignore_regex = [
    (r"py:.*", EXTERNAL + r"(\..*)?"),
    (r"py:.*", r"(Path|Callable|Iterable|Iterator|Sequence|Mapping|Any|Tensor|Module|Generator|Literal)"),
    (r"py:.*", r"(PreTrainedModel|PeftModel)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|object|type|None|slice|complex|load_state_dict)"),
    (r"py:.*", r"(.*\.)?_\w+(\..*)?"),
    (r"py:.*", r"positional_lsh\.cli(\..*)?"),
]

# The rooms whose public modules the reference renders, in the order that decides a re-exported name's home.
ROOMS = (
    "positional_lsh",
    "positional_lsh.ops",
    "positional_lsh.theory",
    "positional_lsh.lm",
    "positional_lsh.integrations",
    "positional_lsh.distributed",
)


def declares_api(module_name: str) -> bool:
    """Whether the module declares a public API: a non-empty ``__all__``."""
    return bool(getattr(importlib.import_module(module_name), "__all__", ()))


def public_modules(room: str) -> list[str]:
    """``room`` and, except for the top-level package (its rooms have their own pages), every module below it that
    is public (no ``_``-prefixed component, no ``__main__``), the package first; of these, those that declare a
    public API (:func:`declares_api`)."""
    if room == "positional_lsh":
        return [room]
    module = importlib.import_module(room)
    below = [
        info.name
        for info in pkgutil.walk_packages(module.__path__, room + ".")
        if not any(part.startswith("_") for part in info.name.split("."))
    ]
    return [name for name in [room, *sorted(below)] if declares_api(name)]


PUBLIC_MODULES: list[str] = [name for room in ROOMS for name in public_modules(room)]


MISSING = object()


def lookup(module: Any, attr: str) -> Any:
    """``module.attr``, or :data:`MISSING` when it is not there (a lazy ``__getattr__`` may fail in any way)."""
    try:
        return getattr(module, attr)
    except Exception:
        return MISSING


def exported(module_name: str) -> list[str]:
    """The module's ``__all__`` (empty when it has none)."""
    return list(getattr(importlib.import_module(module_name), "__all__", ()))


def _assigned(node: ast.stmt) -> list[str]:
    """The names a top-level statement assigns (``x = ...``, ``x: T = ...``)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _source_order(module_name: str) -> dict[str, int]:
    """``name -> line`` of each top-level definition or assignment in the module's source."""
    path = getattr(importlib.import_module(module_name), "__file__", None)
    order: dict[str, int] = {}
    for node in ast.parse(Path(path).read_text(encoding="utf-8")).body if path else []:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            order.setdefault(node.name, node.lineno)
        for target in _assigned(node):
            order.setdefault(target, node.lineno)
    return order


def _assigns(module_name: str, attr: str) -> bool:
    """Whether the module's source assigns ``attr`` at module level (where a constant is defined)."""
    path = getattr(importlib.import_module(module_name), "__file__", None)
    if not path:
        return False
    return any(attr in _assigned(node) for node in ast.parse(Path(path).read_text(encoding="utf-8")).body)


def _homes() -> dict[tuple[int, str], str]:
    """``(id(object), name) -> full name`` under which each exported object is rendered in full."""
    listed: dict[tuple[int, str], list[str]] = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attr in exported(name):
            if lookup(module, attr) is not MISSING:
                listed.setdefault((id(lookup(module, attr)), attr), []).append(name)
    homes = {}
    for (key, attr), modules in listed.items():
        obj = getattr(importlib.import_module(modules[0]), attr)
        defining = getattr(obj, "__module__", None) if inspect.isclass(obj) or inspect.isfunction(obj) else None
        own = [m for m in modules if (m == defining if defining else _assigns(m, attr))]
        homes[(key, attr)] = f"{(own or modules)[0]}.{attr}"
    return homes


HOMES = _homes()


def home_of(module_name: str, attr: str) -> str:
    """The full name under which ``module_name.attr`` is rendered in full (itself when it is its own home)."""
    obj = lookup(importlib.import_module(module_name), attr)
    return HOMES.get((id(obj), attr), f"{module_name}.{attr}")


def aliases() -> dict[str, str]:
    """``full name -> home`` for every exported name that is not its own home."""
    pairs = {}
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attr in exported(name):
            if lookup(module, attr) is not MISSING and home_of(name, attr) != f"{name}.{attr}":
                pairs[f"{name}.{attr}"] = home_of(name, attr)
    return pairs


ALIASES = aliases()


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    return "data"


def _signature(obj: Any) -> str:
    """``(a, b=1, *, c=None)``: the call signature without annotations (they are shown at the object's home)."""
    if not callable(obj):
        return ""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values() if p.name[0] != "_"]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    return text.replace("<factory>", "...")


def _summary(obj: Any) -> str:
    """The docstring's first paragraph, on one line."""
    doc = (obj.__doc__ or "") if not isinstance(obj, (str, int, float, tuple, list, dict)) else ""
    return " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())


def module_rst(module_name: str) -> list[str]:
    """The reStructuredText of one module: a section, its docstring, its own names in full, short re-exports."""
    module = importlib.import_module(module_name)
    title = f"``{module_name}``"
    lines = [title, "-" * len(title), ""]
    own, elsewhere = [], []
    for attr in exported(module_name):
        if lookup(module, attr) is MISSING:
            logger.warning("%s.__all__ lists %r, which cannot be imported from it", module_name, attr)
            continue
        home = home_of(module_name, attr)
        (own if home == f"{module_name}.{attr}" else elsewhere).append((attr, home))
    lines += [f".. automodule:: {module_name}", "   :no-members:", ""]
    order = _source_order(module_name)
    for attr, _ in sorted(own, key=lambda item: order.get(item[0], len(order))):
        kind = _kind(lookup(module, attr))
        directive = {"class": "autoclass", "exception": "autoexception", "function": "autofunction"}.get(kind)
        if directive is None:
            lines += [f".. autodata:: {module_name}.{attr}", ""]
        else:
            lines += [f".. {directive}:: {module_name}.{attr}"]
            lines += ["   :members:", "   :undoc-members:", ""] if kind in {"class", "exception"} else [""]
    for attr, home in elsewhere:
        obj = getattr(module, attr)
        kind = _kind(obj)
        role = {"function": "func", "class": "class", "exception": "exc", "module": "mod"}.get(kind, "data")
        summary = _summary(obj)
        lines += [
            f".. py:{'data' if kind == 'module' else kind}:: {attr}{_signature(obj)}",
            f"   :module: {module_name}",
            "   :no-index:",
            "",
            f"   {summary + ' ' if summary else ''}Documented at :{role}:`{home}`.",
            "",
        ]
    return lines


class ApiModule(SphinxDirective):
    """``.. api-module:: ROOM``: the room's package and its public submodules, one section each."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        text: list[str] = []
        for name in public_modules(self.arguments[0]):
            text += module_rst(name)
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, StringList(text, source=f"api-module {self.arguments[0]}"), container)
        return list(container.children)


def register_aliases(app: Sphinx, env: BuildEnvironment) -> None:
    """Every exported name that is not its home becomes a cross-reference target that links to the home."""
    objects = env.get_domain("py").objects
    for name, home in ALIASES.items():
        entry = objects.get(home)
        if entry is None:
            logger.warning("%s is re-exported as %s but rendered nowhere", home, name)
        elif name not in objects:
            objects[name] = ObjectEntry(entry.docname, entry.node_id, entry.objtype, aliased=True)


def object_at(dotted: str) -> Any:
    """The object a dotted name of the package (``positional_lsh.x.y.attr.member``) leads to, importing the longest
    module prefix; :data:`MISSING` when there is none."""
    parts = dotted.split(".")
    if parts[0] != "positional_lsh":
        return MISSING
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = lookup(obj, attr)
            if obj is MISSING:
                break
        return obj
    return MISSING


def rendered_home(target: str, objects: dict[str, Any]) -> str | None:
    """Where a name of the package that is not rendered itself is rendered: its object's home, or the home of the
    object that holds it (``internal.module.Class.method`` -> ``home.Class.method``); ``None`` when nowhere."""
    parts = target.split(".")
    for i in range(len(parts), 1, -1):
        obj = object_at(".".join(parts[:i]))
        home = HOMES.get((id(obj), parts[i - 1])) if obj is not MISSING else None
        if home is not None and ".".join([home, *parts[i:]]) in objects:
            return ".".join([home, *parts[i:]])
    return None


def documented_module(node: nodes.Node) -> str | None:
    """The module that defines the object whose description holds ``node`` (``None`` outside one, or for data)."""
    parent = node.parent
    while parent is not None and not isinstance(parent, addnodes.desc):
        parent = parent.parent
    signature = parent.children[0] if parent is not None and parent.children else None
    if not isinstance(signature, addnodes.desc_signature) or not signature.get("module"):
        return None
    obj = object_at(f"{signature['module']}.{signature.get('fullname', '')}")
    defining = getattr(obj, "__module__", None) if obj is not MISSING else None
    return defining if isinstance(defining, str) and defining.startswith("positional_lsh") else None


def resolve_in_package(app: Sphinx, env: BuildEnvironment, node: Any, contnode: nodes.Element) -> Any:
    """A Python reference that Sphinx does not find from the current module: try the packages above it, then any
    object whose full name ends with the target, provided all such names lead to one place. A name of the package
    that is not rendered (an internal module's, or one left out of an ``__all__``) leads to where its object is
    rendered, or else stays text; a name that does not exist is left to Sphinx (a warning)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    objects = env.get_domain("py").objects
    head, _, rest = target.rpartition(".")
    while head and rest:  # ``alias.member`` -> ``home.member``
        if head in ALIASES:
            target = f"{ALIASES[head]}.{target[len(head) + 1 :]}"
            break
        head, _, _ = head.rpartition(".")
    parts = (node.get("py:module") or "").split(".")
    candidates = [".".join([*parts[:i], target]) for i in range(len(parts) - 1, 0, -1)]
    found = [c for c in [target, *candidates] if c in objects][:1]
    if not found:
        found = [name for name in objects if name.endswith("." + target)]
    places = {(objects[name].docname, objects[name].node_id) for name in found}
    if len(places) > 1:
        return None
    if not places:  # not rendered: the name as written, in the current class, in the current module or above it
        module, context = node.get("py:module") or "", node.get("py:class")
        names = [target, *([f"{module}.{context}.{target}"] if module and context else [])]
        names += [".".join([*parts[:i], target]) for i in range(len(parts), 0, -1) if parts[0]]
        defining = documented_module(node)  # a re-export's docstring is written in the module that defines it
        names += [f"{defining}.{target}"] if defining else []
        existing = [name for name in names if object_at(name) is not MISSING][:1]
        if not existing:
            return None
        home = rendered_home(existing[0], objects)
        if home is None:
            return contnode  # a name of the package that is not public: shown as text
        places = {(objects[home].docname, objects[home].node_id)}
    docname, node_id = places.pop()
    return make_refnode(app.builder, node.get("refdoc", env.docname), docname, node_id, contnode, target)


def _split_parameters(text: str) -> list[str]:
    """The top-level comma-separated parts of a parameter list (brackets and quotes respected)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


LITERAL_TYPES = (str, int, float, bool, type(None))


def literal_default(param: str, namespace: dict[str, Any]) -> str:
    """``param`` (``name: T = DEFAULT``) with a default written as a constant's name (``DEFAULT_BACKEND``, looked up
    in ``namespace``, the defining module's) shown as its value (``'auto'``) when the value is a plain literal
    (:func:`is_literal`). ``autodoc_preserve_defaults`` keeps the source text, so that a default built by an
    expression reads as written, but a constant's name hides the value that the one-line summaries (which
    re-exports show) and the docstrings state."""
    head, sep, default = param.rpartition("=")
    text = default.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", text) or text in {"None", "True", "False"}:
        return param
    first, *rest = text.split(".")
    value = namespace.get(first, MISSING)
    for attr in rest:
        value = lookup(value, attr)
    return f"{head}{sep} {value!r}" if is_literal(value) else param


def is_literal(value: Any) -> bool:
    """A plain literal: a string, finite number, bool or ``None`` (not an enum member), or a tuple of them."""
    if isinstance(value, tuple):
        return all(is_literal(v) for v in value)
    if isinstance(value, float) and not math.isfinite(value):
        return False  # repr "inf" is not Python; the name (math.inf) reads better
    return isinstance(value, LITERAL_TYPES) and not isinstance(value, enum.Enum)


def public_signature(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str | None, return_annotation: str | None
) -> tuple[str, str | None] | None:
    """The rendered signature: a default that names a constant shows the constant's value (:func:`literal_default`);
    a class's signature also drops its private (``_``-prefixed) parameters, such as a dataclass's internal fields,
    and shows ``...`` for a default made by a factory (``<factory>`` is not Python)."""
    if not signature or not signature.startswith("("):
        return None
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    namespace = vars(module) if module is not None else {}
    written = _split_parameters(signature[1:-1])
    params = [literal_default(p, namespace) for p in written]
    if what in {"class", "exception"}:
        params = [p.replace("<factory>", "...") for p in params if not p.lstrip("*").startswith("_")]
    elif params == written:
        return None  # as autodoc wrote it
    return "(" + ", ".join(params) + ")", return_annotation


def break_after_dots(html: str) -> str:
    """Navigation HTML with a ``<wbr>`` after each dot of a dotted name in its text (not in tags or attributes), so
    that a narrow sidebar breaks ``positional_lsh.integrations.hf`` after a dot, never inside a word."""
    return re.sub(r">([^<]+)<", lambda m: ">" + re.sub(r"(?<=\w)\.(?=\w)", ".<wbr>", m.group(1)) + "<", html)


def navigation_breaks(app: Sphinx, pagename: str, templatename: str, context: dict[str, Any], doctree: Any) -> None:
    """After furo has rendered its navigation tree and table of contents: :func:`break_after_dots` on both."""
    for key in ("furo_navigation_tree", "toc"):
        if isinstance(context.get(key), str):
            context[key] = break_after_dots(context[key])


def drop_type_docstrings(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A constant without a doc comment shows no text, not the docstring of its type (``int``, ``dict``, ...)."""
    if what in {"data", "attribute"} and not callable(obj) and lines:
        type_doc = getattr(type(obj), "__doc__", None)
        type_doc = inspect.cleandoc(type_doc) if isinstance(type_doc, str) else ""
        if type_doc and "\n".join(lines).strip() == type_doc.strip():
            lines[:] = []


def require_docstrings(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A public module, class or function rendered in full without a docstring of its own is an error."""
    if what in {"module", "class", "exception", "function"} and not (obj.__doc__ or "").strip():
        logger.warning("undocumented public %s: %s (give it a docstring)", what, name)
    elif what == "class" and is_dataclass_repr(obj):
        logger.warning("undocumented public class: %s (its docstring is the generated signature)", name)


def is_dataclass_repr(cls: Any) -> bool:
    """Whether a class's docstring is the one ``dataclasses`` writes for a class without one."""
    doc = (cls.__doc__ or "").strip()
    return hasattr(cls, "__dataclass_fields__") and doc.startswith(cls.__name__ + "(")


def _attribute_docstring_as_written(self: Any) -> list[str]:
    # Napoleon reads "text: more" on an attribute's or property's first line as "type: description"; this project
    # writes types as annotations, so such a line is prose.
    return list(self._consume_to_end())


napoleon_docstring.GoogleDocstring._parse_attribute_docstring = _attribute_docstring_as_written  # type: ignore[method-assign]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("api-module", ApiModule, override=True)  # several builds in one process (the tests)
    app.connect("autodoc-process-docstring", drop_type_docstrings, priority=100)  # before napoleon reads it
    app.connect("autodoc-process-docstring", require_docstrings)
    app.connect("autodoc-process-signature", public_signature)
    app.connect("env-updated", register_aliases)
    app.connect("missing-reference", resolve_in_package)
    app.connect("html-page-context", navigation_breaks, priority=900)  # after furo's own handler (500)
    return {"parallel_read_safe": False}
