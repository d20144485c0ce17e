"""Documents: the shipped corpus, your own text files, Hugging Face datasets, and splits by document.

* **The shipped corpus** (``load_corpus``, ``corpus_splits``): 6 Jane Austen novels and 233 State of the
  Union addresses, public-domain English prose of 14.8 M characters, stored compressed inside the package
  (``positional_lsh/lm/corpus/prose.jsonl.xz``; provenance, licences and statistics in ``docs/data.md``).
  Its train/validation/test split is by document and fixed in the file.
* **Your own text** (``load_text_files``): a ``.txt`` file or a directory of them, one document per file
  (or per ``separator``-delimited part); ``split_documents`` splits any document list by document.
* **Hugging Face datasets** (``load_hf_dataset``), optional: WikiText-103, the paper's corpus, is cut
  into articles at its ``= Title =`` headings.
* ``load_splits`` picks one of these from a single source string (e.g. a ``--data`` flag).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.resources
import json
import lzma
import math
import numbers
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

SPLITS: tuple[str, str, str] = ("train", "validation", "test")
"""Split names, in order."""

CORPUS_FILE = "prose.jsonl.xz"

DEFAULT_FRACTIONS: tuple[float, float, float] = (0.9, 0.05, 0.05)

DocumentsLike = Sequence["Document | str"]


def as_path(name: str, value: object, *, must_exist: bool = True) -> Path:
    """``value`` as a ``Path`` (``~`` expanded): ``TypeError`` if it is no path, ``ValueError`` if missing."""
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name} must be a str or os.PathLike path, got {type(value).__name__}")
    path = Path(value).expanduser()
    if must_exist and not path.exists():
        raise ValueError(f"{name} does not exist: {path}")
    return path


# --------------------------------------------------------------------------------------------
# Documents and the shipped corpus
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """One document: a title, its text and where it came from.

    ``split`` is ``"train"``, ``"validation"``, ``"test"`` or ``None`` (not assigned yet).
    """

    title: str
    text: str
    source: str = ""
    id: str = ""
    split: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.title, str):
            raise TypeError(f"title must be a str, got {type(self.title).__name__}")
        if not isinstance(self.text, str):
            raise TypeError(f"text must be a str, got {type(self.text).__name__}")
        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} or None, got {self.split!r}")


def as_documents(name: str, documents: object, *, allow_empty: bool = False) -> list[Document]:
    """Validate a sequence of ``Document`` or ``str`` (a bare string becomes an untitled document)."""
    if isinstance(documents, str | bytes) or not isinstance(documents, Iterable):
        raise TypeError(f"{name} must be a sequence of Document or str, got {type(documents).__name__}")
    out: list[Document] = []
    for i, d in enumerate(documents):
        if isinstance(d, Document):
            out.append(d)
        elif isinstance(d, str):
            out.append(Document(title=f"document {i}", text=d))
        else:
            raise TypeError(f"{name}[{i}] must be a Document or a str, got {type(d).__name__}")
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty: at least one document is needed")
    return out


def corpus_path() -> Path:
    """Path of the shipped corpus file (``positional_lsh/lm/corpus/prose.jsonl.xz``)."""
    return Path(str(importlib.resources.files("positional_lsh.lm") / "corpus" / CORPUS_FILE))


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


@functools.lru_cache(maxsize=4)
def _read_jsonl(path: str, mtime_ns: int) -> tuple[Document, ...]:
    del mtime_ns  # part of the cache key only
    docs: list[Document] = []
    with _open_text(Path(path)) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"path {path}: line {lineno} is not JSON: {exc}") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ValueError(f"path {path}: line {lineno} must be a JSON object with a string 'text'")
            docs.append(
                Document(
                    title=str(rec.get("title", f"document {len(docs)}")),
                    text=rec["text"],
                    source=str(rec.get("source", "")),
                    id=str(rec.get("id", "")),
                    split=rec.get("split"),
                )
            )
    return tuple(docs)


def load_corpus(path: str | os.PathLike[str] | None = None) -> list[Document]:
    """Load a corpus of documents stored as JSON lines (``.jsonl``, ``.jsonl.xz`` or ``.jsonl.gz``).

    Each line is an object with ``text`` and optionally ``title``, ``source``, ``id`` and ``split``.
    With ``path=None`` this is the shipped corpus: 239 documents (6 Jane Austen novels, then 233 State of
    the Union addresses in chronological order), each with its fixed ``split``.
    """
    p = corpus_path() if path is None else as_path("path", path)
    if not p.is_file():
        raise ValueError(f"path must be a file, got {p}")
    docs = _read_jsonl(str(p.resolve()), p.stat().st_mtime_ns)
    if not docs:
        raise ValueError(f"path {p} holds no documents")
    return list(docs)


def corpus_splits(documents: DocumentsLike | None = None) -> dict[str, list[Document]]:
    """Group documents by their stored ``split``: ``{"train": [...], "validation": [...], "test": [...]}``.

    With ``documents=None`` this is the shipped corpus, split by document with the fixed rule of
    ``docs/data.md``: Northanger Abbey -> validation, Persuasion -> test, the other four novels -> train; the
    State of the Union addresses, numbered ``k = 0, 1, ...`` in chronological order, go to validation when
    ``k % 20 == 9``, to test when ``k % 20 == 19`` and to train otherwise (214 / 13 / 12 documents).
    """
    docs = load_corpus() if documents is None else as_documents("documents", documents)
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for i, d in enumerate(docs):
        if d.split is None:
            raise ValueError(f"documents[{i}] ({d.title!r}) has no split; use split_documents() to assign splits")
        out[d.split].append(d)
    return out


def split_documents(
    documents: DocumentsLike,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
) -> dict[str, list[Document]]:
    """Split documents into train/validation/test **by document** (no document is ever cut).

    Rule: the document indices are shuffled with ``random.Random(seed)``; the first
    ``round(n * fractions[1])`` shuffled documents go to validation, the next ``round(n * fractions[2])``
    to test, the rest to train. A split with a positive fraction gets at least one document when
    ``n >= 3``. Within each split documents keep their input order. Returns documents with ``split`` set.
    """
    docs = as_documents("documents", documents)
    if isinstance(fractions, str | bytes) or not isinstance(fractions, Sequence) or len(fractions) != 3:
        raise TypeError("fractions must be a sequence of 3 numbers (train, validation, test)")
    fr: list[float] = []
    for f in fractions:
        if isinstance(f, bool) or not isinstance(f, numbers.Real):
            raise TypeError(f"fractions must hold numbers, got {type(f).__name__}")
        if not math.isfinite(f) or f < 0:
            raise ValueError(f"fractions must be finite and >= 0, got {list(fractions)}")
        fr.append(float(f))
    if fr[0] <= 0 or not math.isclose(sum(fr), 1.0, abs_tol=1e-6):
        raise ValueError(f"fractions must sum to 1 with a positive train fraction, got {list(fractions)}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    n = len(docs)
    n_val, n_test = round(n * fr[1]), round(n * fr[2])
    if n >= 3:
        n_val = max(n_val, 1 if fr[1] > 0 else 0)
        n_test = max(n_test, 1 if fr[2] > 0 else 0)
    while n_val + n_test > n - 1:  # keep at least one training document
        if n_test >= n_val and n_test > 0:
            n_test -= 1
        else:
            n_val -= 1
    order = list(range(n))
    random.Random(int(seed)).shuffle(order)
    assign = ["train"] * n
    for i in order[:n_val]:
        assign[i] = "validation"
    for i in order[n_val : n_val + n_test]:
        assign[i] = "test"
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d, s in zip(docs, assign, strict=True):
        out[s].append(dataclasses.replace(d, split=s))
    return out


# --------------------------------------------------------------------------------------------
# User text and Hugging Face datasets
# --------------------------------------------------------------------------------------------


def read_text_file(path: str | os.PathLike[str], *, encoding: str = "utf-8", what: str = "path") -> str:
    """The text of one file, refused (``ValueError`` naming the file; ``what`` names the flag or argument) unless it
    is text: valid ``encoding`` and no NUL bytes (a binary file such as an executable is not decoded with
    replacement characters)."""
    f = as_path(what, path)
    if not f.is_file():
        raise ValueError(f"{what} {f} is not a file")
    try:
        text = f.read_text(encoding=encoding)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {f} is not valid {encoding} text ({exc.reason} at byte {exc.start}); "
                         "pass text files") from None  # fmt: skip
    if "\x00" in text:
        raise ValueError(f"{what} {f} holds NUL bytes: it looks binary, not text; pass text files")
    return text


def load_text_files(
    path: str | os.PathLike[str],
    *,
    pattern: str = "*.txt",
    separator: str | None = None,
    encoding: str = "utf-8",
) -> list[Document]:
    """Load your own text: a file, or every file matching ``pattern`` under a directory (recursively).

    Each file is one document titled by its path (relative to the directory), in sorted path order. With
    ``separator`` (e.g. ``"\\n\\n\\n"``) each file is cut into several documents at that string. Files
    and parts that are empty or whitespace only are skipped.
    """
    p = as_path("path", path)
    if not isinstance(pattern, str) or not pattern:
        raise TypeError("pattern must be a non-empty str such as '*.txt'")
    if separator is not None and (not isinstance(separator, str) or not separator):
        raise TypeError("separator must be a non-empty str or None")
    if p.is_dir():
        files = sorted(f for f in p.rglob(pattern) if f.is_file())
        if not files:
            raise ValueError(f"path {p} has no files matching {pattern!r}")
        named = [(f, f.relative_to(p).as_posix()) for f in files]
    elif p.is_file():
        named = [(p, p.name)]
    else:
        raise ValueError(f"path must be a file or a directory, got {p}")
    docs: list[Document] = []
    for f, name in named:
        text = read_text_file(f, encoding=encoding)
        parts = [text] if separator is None else text.split(separator)
        parts = [t for t in parts if t.strip()]
        for j, t in enumerate(parts):
            title = name if len(parts) == 1 else f"{name} #{j + 1}"
            docs.append(Document(title=title, text=t, source=str(f), id=title))
    if not docs:
        raise ValueError(f"path {p}: every file is empty")
    return docs


def _wikitext_title(line: str) -> str | None:
    """The title if ``line`` is a WikiText article heading ``= Title =`` (not ``= = Section = =``)."""
    s = line.strip()
    if len(s) > 4 and s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
        return s[2:-2].strip()
    return None


def split_wikitext_articles(lines: Iterable[str], *, source: str = "wikitext") -> list[Document]:
    """Cut WikiText lines (the rows of its ``text`` column) into articles at ``= Title =`` headings.

    Section headings (``= = Section = =``) stay inside their article. Each article's text starts with its
    heading line, as in the WikiText files; text before the first heading, if any, is one more document.
    """
    if isinstance(lines, str | bytes) or not isinstance(lines, Iterable):
        raise TypeError(f"lines must be an iterable of str, got {type(lines).__name__}")
    docs: list[Document] = []
    title: str | None = None
    buf: list[str] = []

    def flush() -> None:
        text = "".join(buf).strip("\n")
        if text.strip():
            t = title if title is not None else "(before the first heading)"
            docs.append(Document(title=t, text=text + "\n", source=source, id=t))

    for i, line in enumerate(lines):
        if not isinstance(line, str):
            raise TypeError(f"lines[{i}] must be a str, got {type(line).__name__}")
        heading = _wikitext_title(line)
        if heading is not None:
            flush()
            title, buf = heading, []
        buf.append(line if line.endswith("\n") else line + "\n")
    flush()
    if not docs:
        raise ValueError("lines hold no text")
    return docs


def load_hf_dataset(
    path: str = "wikitext",
    name: str | None = "wikitext-103-raw-v1",
    *,
    split: str = "train",
    text_field: str = "text",
    articles: bool | None = None,
    **load_kwargs: Any,
) -> list[Document]:
    """Load one split of a Hugging Face ``datasets`` dataset as documents (needs the optional ``datasets``).

    The default is WikiText-103 (raw), the paper's corpus. ``articles`` (default: on when ``path`` names
    WikiText) cuts the line-per-row WikiText format into articles with ``split_wikitext_articles``;
    otherwise every non-empty row is one document. ``load_kwargs`` go to ``datasets.load_dataset``
    (e.g. ``cache_dir``). This library never downloads by itself, but ``datasets`` will unless the data
    are in its cache; set ``HF_DATASETS_OFFLINE=1`` to forbid that.
    """
    for arg, value in (("path", path), ("split", split), ("text_field", text_field)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{arg} must be a non-empty str, got {value!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    if articles is not None and not isinstance(articles, bool):
        raise TypeError(f"articles must be a bool or None, got {type(articles).__name__}")
    try:
        import datasets  # optional dependency, imported lazily
    except ImportError as exc:
        raise ImportError(
            "load_hf_dataset needs the optional Hugging Face 'datasets' package: "
            "pip install 'positional-lsh[data]' (or pip install datasets)"
        ) from exc
    ds = datasets.load_dataset(path, name, split=split, **load_kwargs)
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_field not in columns:
        raise ValueError(f"text_field {text_field!r} is not a column of {path}; columns: {columns}")
    rows = (row[text_field] for row in ds)
    source = f"{path}/{name}:{split}" if name else f"{path}:{split}"
    if articles if articles is not None else "wikitext" in path.lower():
        return split_wikitext_articles(rows, source=source)
    docs = [
        Document(title=f"{source} #{i}", text=t, source=source, id=f"{source} #{i}")
        for i, t in enumerate(rows)
        if isinstance(t, str) and t.strip()
    ]
    if not docs:
        raise ValueError(f"split {split!r} of {path} has no non-empty {text_field!r} rows")
    return docs


def load_splits(
    source: str | os.PathLike[str] | None = None,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
) -> dict[str, list[Document]]:
    """Documents for training and evaluation, by split, from one ``source`` string (e.g. a ``--data`` flag).

    * ``None`` or ``"default"``: the shipped corpus with its fixed split (``corpus_splits``).
    * ``"hf:PATH[:NAME]"``, e.g. ``"hf:wikitext:wikitext-103-raw-v1"``: the dataset's own train,
      validation and test splits (``load_hf_dataset``).
    * a ``.jsonl``/``.jsonl.xz``/``.jsonl.gz`` file: its stored splits if every document has one, else
      ``split_documents(fractions, seed)``.
    * a directory with ``train``, ``validation`` (or ``valid``) and ``test`` subdirectories: those.
    * any other ``.txt`` file or directory: ``load_text_files`` then ``split_documents(fractions, seed)``; with
      fewer than 3 documents (e.g. one text file) ``split_by_position(fractions)`` instead.
    """
    if source is None or source == "default":
        return corpus_splits()
    if isinstance(source, str) and source.startswith("hf:"):
        path, _, name = source[3:].partition(":")
        if not path:
            raise ValueError(f"source must look like 'hf:PATH[:NAME]', got {source!r}")
        return {
            s: [dataclasses.replace(d, split=s) for d in load_hf_dataset(path, name or None, split=s)] for s in SPLITS
        }
    p = as_path("source", source)
    if p.is_file() and any(p.name.endswith(ext) for ext in (".jsonl", ".jsonl.xz", ".jsonl.gz")):
        docs = load_corpus(p)
        if all(d.split is not None for d in docs):
            return corpus_splits(docs)
        return split_documents(docs, fractions, seed)
    if p.is_dir() and (p / "train").is_dir() and (p / "test").is_dir():
        val = p / "validation" if (p / "validation").is_dir() else p / "valid"
        if not val.is_dir():
            raise ValueError(f"source {p} has train/ and test/ but no validation/ (or valid/) directory")
        return {
            s: [dataclasses.replace(d, split=s) for d in load_text_files(q)]
            for s, q in zip(SPLITS, (p / "train", val, p / "test"), strict=True)
        }
    docs = load_text_files(p)
    if len(docs) < 3:  # too few documents to split by document: split the text by position
        return split_by_position(docs, fractions)
    return split_documents(docs, fractions, seed)


def split_by_position(
    documents: DocumentsLike, fractions: Sequence[float] = DEFAULT_FRACTIONS
) -> dict[str, list[Document]]:
    """Split text too short in documents (one file, say) **by position**: the documents are joined, and the
    first ``fractions[0]`` of the characters go to train, the next ``fractions[1]`` to validation, the rest to
    test, each cut moved forward to the next line break (or space) when there is one nearby.
    """
    docs = as_documents("documents", documents)
    if len(fractions) != 3 or fractions[0] <= 0 or any(not 0 <= f for f in fractions):
        raise ValueError(f"fractions must be 3 numbers >= 0 with a positive train fraction, got {list(fractions)}")
    text = "\n\n".join(d.text for d in docs)
    n = len(text)
    if n < 100:
        raise ValueError(f"{docs[0].source or 'the text'} has only {n} characters: too little to split into "
                         "train/validation/test; pass more text")  # fmt: skip
    cuts = [0]
    for f in (fractions[0], fractions[0] + fractions[1]):
        at = max(cuts[-1] + 1, min(n - 1, round(n * f)))
        nl = text.find("\n", at, at + 2000)
        sp = text.find(" ", at, at + 200)
        cuts.append(nl + 1 if nl >= 0 else sp + 1 if sp >= 0 else at)
    cuts.append(n)
    src, title = docs[0].source, docs[0].title
    return {
        s: [Document(title=f"{title} ({s})", text=text[a:b], source=src, id=f"{title}:{s}", split=s)]
        for s, a, b in zip(SPLITS, cuts[:-1], cuts[1:], strict=True)
    }
