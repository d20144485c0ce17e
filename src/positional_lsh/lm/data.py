"""Data for language-model training and evaluation: corpus, tokenizer, token streams and windows.

* **The shipped corpus** (``load_corpus``, ``corpus_splits``): 6 Jane Austen novels and 233 State of the
  Union addresses, public-domain English prose of 14.8 M characters, stored compressed inside the package
  (``positional_lsh/corpus/prose.jsonl.xz``; provenance, licences and statistics in ``docs/data.md``).
  Its train/validation/test split is by document and fixed in the file.
* **Your own text** (``load_text_files``): a ``.txt`` file or a directory of them, one document per file
  (or per ``separator``-delimited part); ``split_documents`` splits any document list by document.
* **Hugging Face datasets** (``load_hf_dataset``), optional: WikiText-103, the paper's corpus, is cut
  into articles at its `` = Title = `` headings.
* **A byte-level BPE tokenizer** (``BPETokenizer``) trained locally with ``tokenizers`` (default vocabulary
  8192), deterministic, saved as one JSON file (with every checkpoint).
* **Token streams** (``encode_documents``, ``encode_splits``): each split becomes one long 1-D token tensor,
  every document followed by the end-of-document token.
* **Windows** (``random_batch``, ``random_windows``, ``sliding_windows``): ``(inputs, targets)`` pairs of
  shape ``(batch, seq_len)`` with ``targets`` the inputs shifted by one token; seeded random windows for
  training, strided sliding windows for evaluation in which every token is scored exactly once.

Nothing here downloads: the corpus ships with the package and the tokenizer is trained locally.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import json
import lzma
import math
import numbers
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from positional_lsh.ops._checks import as_generator, positive_int

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "EOD_TOKEN",
    "SPLITS",
    "BPETokenizer",
    "Document",
    "corpus_path",
    "corpus_splits",
    "encode_documents",
    "encode_splits",
    "load_corpus",
    "load_hf_dataset",
    "load_splits",
    "load_text_files",
    "load_tokenizer",
    "num_sliding_windows",
    "random_batch",
    "random_windows",
    "sliding_windows",
    "split_documents",
    "split_wikitext_articles",
    "train_tokenizer",
]

SPLITS: tuple[str, str, str] = ("train", "validation", "test")
"""Split names, in order."""

EOD_TOKEN = "<|endoftext|>"
"""The end-of-document token placed after every document in a token stream."""

DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB_SIZE = 257  # the 256 byte symbols + the end-of-document token

CORPUS_FILE = "prose.jsonl.xz"

DEFAULT_FRACTIONS: tuple[float, float, float] = (0.9, 0.05, 0.05)

DocumentsLike = Sequence["Document | str"]


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _as_path(name: str, value: object, *, must_exist: bool = True) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name} must be a str or os.PathLike path, got {type(value).__name__}")
    path = Path(value).expanduser()
    if must_exist and not path.exists():
        raise ValueError(f"{name} does not exist: {path}")
    return path


def _as_tokens(name: str, value: object, min_len: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one token stream), got shape {tuple(value.shape)}")
    if value.numel() < min_len:
        raise ValueError(f"{name} has {value.numel()} tokens; at least {min_len} (seq_len + 1) are needed")
    return value


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


def _as_documents(name: str, documents: object, *, allow_empty: bool = False) -> list[Document]:
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
    """Path of the shipped corpus file (``positional_lsh/corpus/prose.jsonl.xz``)."""
    return Path(str(importlib.resources.files(__package__ or "positional_lsh") / "corpus" / CORPUS_FILE))


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


@functools.lru_cache(maxsize=4)
def _read_jsonl(path: str, mtime_ns: int) -> tuple[Document, ...]:
    del mtime_ns  # part of the cache key only
    docs = []
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
    p = corpus_path() if path is None else _as_path("path", path)
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
    docs = load_corpus() if documents is None else _as_documents("documents", documents)
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
    docs = _as_documents("documents", documents)
    if isinstance(fractions, str | bytes) or not isinstance(fractions, Sequence) or len(fractions) != 3:
        raise TypeError("fractions must be a sequence of 3 numbers (train, validation, test)")
    fr = []
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
    p = _as_path("path", path)
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
        try:
            text = f.read_text(encoding=encoding)
        except UnicodeDecodeError as exc:
            raise ValueError(f"path {f} is not valid {encoding} text: {exc}") from None
        parts = [text] if separator is None else text.split(separator)
        parts = [t for t in parts if t.strip()]
        for j, t in enumerate(parts):
            title = name if len(parts) == 1 else f"{name} #{j + 1}"
            docs.append(Document(title=title, text=t, source=str(f), id=title))
    if not docs:
        raise ValueError(f"path {p}: every file is empty")
    return docs


def _wikitext_title(line: str) -> str | None:
    """The title if ``line`` is a WikiText article heading `` = Title = `` (not `` = = Section = = ``)."""
    s = line.strip()
    if len(s) > 4 and s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
        return s[2:-2].strip()
    return None


def split_wikitext_articles(lines: Iterable[str], *, source: str = "wikitext") -> list[Document]:
    """Cut WikiText lines (the rows of its ``text`` column) into articles at `` = Title = `` headings.

    Section headings (`` = = Section = = ``) stay inside their article. Each article's text starts with its
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
    * any other ``.txt`` file or directory: ``load_text_files`` then ``split_documents(fractions, seed)``.
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
    p = _as_path("source", source)
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
    return split_documents(load_text_files(p), fractions, seed)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _chunks(text: str, size: int) -> list[str]:
    """Cut ``text`` into pieces of about ``size`` characters at a space that follows a non-space.

    Such a point is always a pre-token boundary of the GPT-2 byte-level regex (no pre-token has a space
    after its first character unless it is all whitespace), so encoding the pieces gives exactly the ids
    of encoding the whole text; it is only faster on long documents.
    """
    if len(text) <= size:
        return [text]
    out = []
    start = 0
    while len(text) - start > size:
        cut = text.find(" ", start + size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


class BPETokenizer:
    """A byte-level BPE tokenizer (GPT-2 style, via ``tokenizers``) with an end-of-document token.

    Every string round-trips exactly: ``decode(encode(s)) == s``. The literal text ``<|endoftext|>``
    in a document is encoded as ordinary text; the end-of-document id only comes from
    ``encode_documents``. Use ``BPETokenizer.train`` (or ``train_tokenizer``) to make one, ``save`` /
    ``BPETokenizer.load`` to store it (one JSON file, the ``tokenizers`` format).
    """

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        eod = tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"tokenizer has no end-of-document token {EOD_TOKEN!r}")
        tokenizer.encode_special_tokens = True  # a literal "<|endoftext|>" in text is just text
        self._tok = tokenizer
        self._eod = int(eod)
        cfg = json.loads(tokenizer.to_str())
        pre = cfg.get("pre_tokenizer") or {}
        self._chunkable = (
            cfg.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
        )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: DocumentsLike,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        *,
        min_frequency: int = 2,
        max_chars: int | None = None,
    ) -> BPETokenizer:
        """Train a byte-level BPE on ``texts`` (documents or strings). Deterministic for the same input.

        ``vocab_size`` counts the 256 byte symbols and the end-of-document token (so it must be >= 257);
        a small corpus may yield fewer tokens (``vocab_size`` of the result tells). ``max_chars`` caps
        the characters used for training (the first ones, in document order) to make it faster.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        docs = _as_documents("texts", texts)
        vocab_size = positive_int("vocab_size", vocab_size)
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {EOD_TOKEN}), got {vocab_size}")
        min_frequency = positive_int("min_frequency", min_frequency)
        if max_chars is not None:
            max_chars = positive_int("max_chars", max_chars)
        sample: list[str] = []
        budget = max_chars if max_chars is not None else math.inf
        for d in docs:
            if budget <= 0:
                break
            piece = d.text if len(d.text) <= budget else d.text[: int(budget)]
            sample.extend(_chunks(piece, 1 << 16))
            budget -= len(piece)
        if not any(t.strip() for t in sample):
            raise ValueError("texts hold no text to train on")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
        return cls(tok)

    @classmethod
    def from_str(cls, data: str) -> BPETokenizer:
        """Rebuild from the JSON string of ``to_str`` (e.g. stored inside a checkpoint)."""
        from tokenizers import Tokenizer

        if not isinstance(data, str):
            raise TypeError(f"data must be a str (tokenizer JSON), got {type(data).__name__}")
        try:
            return cls(Tokenizer.from_str(data))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            if isinstance(exc, TypeError | ValueError):
                raise
            raise ValueError(f"data is not a valid tokenizer JSON: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        """Load from a ``tokenizer.json`` file or a directory holding one."""
        p = _as_path("path", path)
        if p.is_dir():
            p = p / "tokenizer.json"
            if not p.is_file():
                raise ValueError(f"path {p.parent} holds no tokenizer.json")
        return cls.from_str(p.read_text(encoding="utf-8"))

    def to_str(self) -> str:
        """The tokenizer as a JSON string (the ``tokenizers`` format)."""
        return self._tok.to_str()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save as JSON. A path ending in ``.json`` is the file; any other path is a directory (created if
        needed) that receives ``tokenizer.json``. Returns the file written."""
        p = _as_path("path", path, must_exist=False)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / "tokenizer.json"
        elif not p.parent.exists():
            raise ValueError(f"path's directory does not exist: {p.parent}")
        p.write_text(self.to_str(), encoding="utf-8")
        return p

    # -- properties --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including the end-of-document token): the embedding size a model needs."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod_id(self) -> int:
        """Id of the end-of-document token ``<|endoftext|>``."""
        return self._eod

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer JSON: equal fingerprints mean equal tokenizers."""
        return hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and self.to_str() == other.to_str()

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id})"

    # -- encode / decode ---------------------------------------------------------------------

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no end-of-document token added)."""
        if isinstance(texts, str | bytes) or not isinstance(texts, Sequence):
            raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
        pieces: list[str] = []
        counts: list[int] = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
            parts = _chunks(t, 8192) if self._chunkable else [t]
            pieces.extend(parts)
            counts.append(len(parts))
        encoded = self._tok.encode_batch(pieces, add_special_tokens=False) if pieces else []
        out: list[list[int]] = []
        k = 0
        for c in counts:
            ids: list[int] = []
            for e in encoded[k : k + c]:
                ids.extend(e.ids)
            out.append(ids)
            k += c
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of one text (no end-of-document token added)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of a sequence of ids (a list or a 1-D integer tensor). End-of-document ids decode to
        ``<|endoftext|>``."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise TypeError(f"ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
            ids = ids.tolist()
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"ids must be a sequence of int, got {type(ids).__name__}")
        n = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"ids[{i}] must be an int, got {type(t).__name__}")
            if not 0 <= t < n:
                raise ValueError(f"ids[{i}] = {t} is outside the vocabulary [0, {n})")
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=False)


def train_tokenizer(
    texts: DocumentsLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    min_frequency: int = 2,
    max_chars: int | None = None,
) -> BPETokenizer:
    """Train a byte-level BPE tokenizer locally; see ``BPETokenizer.train``."""
    return BPETokenizer.train(texts, vocab_size, min_frequency=min_frequency, max_chars=max_chars)


def load_tokenizer(path: str | os.PathLike[str]) -> BPETokenizer:
    """Load a tokenizer saved with ``BPETokenizer.save`` (a ``.json`` file or a directory)."""
    return BPETokenizer.load(path)


# --------------------------------------------------------------------------------------------
# Token streams
# --------------------------------------------------------------------------------------------


def encode_documents(
    tokenizer: BPETokenizer,
    documents: DocumentsLike,
    *,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """One 1-D token tensor for a list of documents: ``doc_0 EOD doc_1 EOD ... doc_last EOD``."""
    if not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"tokenizer must be a BPETokenizer, got {type(tokenizer).__name__}")
    docs = _as_documents("documents", documents)
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"dtype must be an integer torch.dtype, got {dtype}")
    if dtype in (torch.uint8, torch.int8, torch.int16) or (dtype == torch.int32 and tokenizer.vocab_size > 2**31):
        raise ValueError(f"dtype {dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use torch.int32 or long")
    ids = tokenizer.encode_batch([d.text for d in docs])
    total = sum(len(x) + 1 for x in ids)
    out = torch.empty(total, dtype=dtype)
    pos = 0
    for x in ids:
        out[pos : pos + len(x)] = torch.tensor(x, dtype=dtype)
        pos += len(x)
        out[pos] = tokenizer.eod_id
        pos += 1
    return out


def encode_splits(
    tokenizer: BPETokenizer,
    splits: Mapping[str, DocumentsLike],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.long,
) -> dict[str, torch.Tensor]:
    """``encode_documents`` for each split: ``{"train": tensor, "validation": tensor, "test": tensor}``.

    With ``cache_dir`` the token tensors are stored there (``tokens-<hash>.pt``, keyed by the tokenizer
    and the exact texts) and reused on the next call with the same tokenizer and documents.
    """
    if not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"tokenizer must be a BPETokenizer, got {type(tokenizer).__name__}")
    if not isinstance(splits, Mapping):
        raise TypeError(f"splits must be a mapping from split name to documents, got {type(splits).__name__}")
    if not splits:
        raise ValueError("splits is empty")
    docs = {}
    for name, part in splits.items():
        if not isinstance(name, str):
            raise TypeError(f"splits keys must be str, got {type(name).__name__}")
        docs[name] = _as_documents(f"splits[{name!r}]", part)
    cache_file: Path | None = None
    if cache_dir is not None:
        h = hashlib.sha256(tokenizer.to_str().encode("utf-8"))
        h.update(str(dtype).encode())
        for name in sorted(docs):
            h.update(b"\x00split\x00" + name.encode("utf-8"))
            for d in docs[name]:
                h.update(b"\x00doc\x00" + d.text.encode("utf-8"))
        cdir = _as_path("cache_dir", cache_dir, must_exist=False)
        cache_file = cdir / f"tokens-{h.hexdigest()[:20]}.pt"
        if cache_file.is_file():
            cached = torch.load(cache_file, weights_only=True)
            if isinstance(cached, dict) and set(cached) == set(docs):
                return cached
    out = {name: encode_documents(tokenizer, part, dtype=dtype) for name, part in docs.items()}
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        torch.save(out, tmp)
        os.replace(tmp, cache_file)
    return out


# --------------------------------------------------------------------------------------------
# Windows
# --------------------------------------------------------------------------------------------


def random_batch(
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    *,
    generator: torch.Generator | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random contiguous windows: ``inputs = tokens[s:s+seq_len]``,
    ``targets = tokens[s+1:s+seq_len+1]``, with starts ``s`` uniform over all valid positions.

    Returns two ``(batch_size, seq_len)`` ``torch.long`` tensors. ``generator`` is a CPU
    ``torch.Generator``, an int seed, or ``None`` for torch's global generator.
    """
    seq_len = positive_int("seq_len", seq_len)
    batch_size = positive_int("batch_size", batch_size)
    tokens = _as_tokens("tokens", tokens, seq_len + 1)
    g = as_generator(generator, "generator")
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = tokens[idx.to(tokens.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


def random_windows(
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int,
    *,
    generator: torch.Generator | int | None = None,
    num_batches: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An iterator of ``random_batch`` batches (endless unless ``num_batches`` is given).

    An int ``generator`` seeds one generator for the whole sequence, so the same seed gives the same
    batches.
    """
    seq_len = positive_int("seq_len", seq_len)
    batch_size = positive_int("batch_size", batch_size)
    tokens = _as_tokens("tokens", tokens, seq_len + 1)
    g = as_generator(generator, "generator")
    if num_batches is not None:
        num_batches = positive_int("num_batches", num_batches)

    def gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        i = 0
        while num_batches is None or i < num_batches:
            yield random_batch(tokens, seq_len, batch_size, generator=g)
            i += 1

    return gen()


def _window_starts(num_tokens: int, seq_len: int, stride: int) -> list[int]:
    last = num_tokens - 1 - seq_len  # the last start whose targets stay inside the stream
    starts = list(range(0, last + 1, stride))
    if starts[-1] != last:
        starts.append(last)
    return starts


def num_sliding_windows(num_tokens: int, seq_len: int, stride: int | None = None) -> int:
    """How many windows ``sliding_windows`` yields for a stream of ``num_tokens`` tokens."""
    num_tokens = positive_int("num_tokens", num_tokens)
    seq_len = positive_int("seq_len", seq_len)
    stride = seq_len if stride is None else positive_int("stride", stride)
    if stride > seq_len:
        raise ValueError(f"stride must be <= seq_len ({seq_len}) so that every token is scored, got {stride}")
    if num_tokens < seq_len + 1:
        raise ValueError(f"num_tokens must be >= seq_len + 1 = {seq_len + 1}, got {num_tokens}")
    return len(_window_starts(num_tokens, seq_len, stride))


def sliding_windows(
    tokens: torch.Tensor,
    seq_len: int,
    stride: int | None = None,
    *,
    batch_size: int = 1,
    ignore_index: int = -100,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Strided windows for sliding-window evaluation (the ALiBi paper's protocol).

    Windows of ``seq_len`` inputs start at ``0, stride, 2*stride, ...``; one more window ending at the
    last token is added when needed, so that every window has full length. ``targets`` are the inputs
    shifted by one, with ``ignore_index`` (``cross_entropy``'s default -100) at positions already scored
    by an earlier window: the first window scores all ``seq_len`` positions, each later one only its new
    tokens (its last ``stride`` when it is a regular window), with the earlier ones as context. Every
    token after the first is scored exactly once. ``stride = seq_len`` (the default) gives disjoint windows.

    Yields ``(inputs, targets)`` of shape ``(b, seq_len)``, ``torch.long``, ``b <= batch_size`` (the
    last batch may be smaller).
    """
    seq_len = positive_int("seq_len", seq_len)
    stride = seq_len if stride is None else positive_int("stride", stride)
    batch_size = positive_int("batch_size", batch_size)
    if stride > seq_len:
        raise ValueError(f"stride must be <= seq_len ({seq_len}) so that every token is scored, got {stride}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    tokens = _as_tokens("tokens", tokens, seq_len + 1)
    starts = _window_starts(tokens.numel(), seq_len, stride)
    offsets = torch.arange(seq_len + 1, device=tokens.device)

    def gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        scored_until = 0  # targets are token indices; index 0 is never a target
        for b in range(0, len(starts), batch_size):
            group = starts[b : b + batch_size]
            idx = torch.tensor(group, device=tokens.device)[:, None] + offsets
            chunk = tokens[idx].long()
            inputs, targets = chunk[:, :-1], chunk[:, 1:].clone()
            for row, s in enumerate(group):
                already = scored_until - s  # targets s+1 .. scored_until were scored before
                if already > 0:
                    targets[row, :already] = ignore_index
                scored_until = s + seq_len
            yield inputs, targets

    return gen()
