"""The byte-level BPE tokenizer and token streams.

* **A byte-level BPE tokenizer** (``BPETokenizer``) trained locally with ``tokenizers`` (default vocabulary
  8192), deterministic, saved as one JSON file (with every checkpoint).
* **Token streams** (``encode_documents``, ``encode_splits``): each split becomes one long 1-D token tensor,
  every document followed by the end-of-document token.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from positional_lsh.lm.data.corpus import Document, DocumentsLike, as_documents, as_path
from positional_lsh.ops.checks import positive_int
from positional_lsh.ops.errors import UserError

EOD_TOKEN = "<|endoftext|>"
"""The end-of-document token placed after every document in a token stream."""

DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB_SIZE = 257  # the 256 byte symbols + the end-of-document token


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


def _training_sample(texts: list[str], max_chars: int | None) -> list[str]:
    """The first ``max_chars`` characters of ``texts`` (all with ``None``), cut into pieces of 64 K characters."""
    sample: list[str] = []
    budget = max_chars if max_chars is not None else math.inf
    for text in texts:
        if budget <= 0:
            break
        piece = text if len(text) <= budget else text[: int(budget)]
        sample.extend(_chunks(piece, 1 << 16))
        budget -= len(piece)
    return sample


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

        docs = as_documents("texts", texts)
        vocab_size = positive_int("vocab_size", vocab_size)
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {EOD_TOKEN}), got {vocab_size}")
        min_frequency = positive_int("min_frequency", min_frequency)
        if max_chars is not None:
            max_chars = positive_int("max_chars", max_chars)
        sample = _training_sample([d.text for d in docs], max_chars)
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
        p = as_path("path", path)
        if p.is_dir():
            p = p / "tokenizer.json"
            if not p.is_file():
                raise ValueError(f"path {p.parent} holds no tokenizer.json")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{p} is not a tokenizer.json: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        except IsADirectoryError:
            raise ValueError(f"{p} is a directory, not a tokenizer.json") from None
        try:
            return cls.from_str(text)
        except ValueError as exc:
            raise ValueError(f"{p} is not a valid tokenizer.json ({' '.join(str(exc).split())[:160]})") from None

    def to_str(self) -> str:
        """The tokenizer as a JSON string (the ``tokenizers`` format)."""
        return self._tok.to_str()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save as JSON. A path ending in ``.json`` is the file; any other path is a directory (created if
        needed) that receives ``tokenizer.json``. Returns the file written."""
        p = as_path("path", path, must_exist=False)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / "tokenizer.json"
        elif not p.parent.exists():
            raise ValueError(f"path's directory does not exist: {p.parent}")
        tmp = p.with_name(p.name + ".tmp")  # through a temporary name: a full disk never leaves a torn file
        try:
            tmp.write_text(self.to_str(), encoding="utf-8")
            os.replace(tmp, p)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
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
    docs = as_documents("documents", documents)
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
    docs: dict[str, list[Document]] = {}
    for name, part in splits.items():
        if not isinstance(name, str):
            raise TypeError(f"splits keys must be str, got {type(name).__name__}")
        docs[name] = as_documents(f"splits[{name!r}]", part)
    cache_file: Path | None = None
    if cache_dir is not None:
        cdir = as_path("cache_dir", cache_dir, must_exist=False)
        cache_file = cdir / f"tokens-{_cache_key(tokenizer, docs, dtype)}.pt"
        if cache_file.is_file():
            try:
                cached = torch.load(cache_file, weights_only=True)
            except Exception:  # torch raises many kinds for a damaged file
                raise UserError(
                    f"token cache {cache_file} is corrupt or truncated; delete it (it is rebuilt) or pass "
                    "--cache-dir ''"
                ) from None
            if isinstance(cached, dict) and set(cached) == set(docs):
                return cached
    out = {name: encode_documents(tokenizer, part, dtype=dtype) for name, part in docs.items()}
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        torch.save(out, tmp)
        os.replace(tmp, cache_file)
    return out


def _cache_key(tokenizer: BPETokenizer, docs: Mapping[str, list[Document]], dtype: torch.dtype) -> str:
    """20 hex digits of SHA-256 over the tokenizer, the dtype and every split's document texts."""
    h = hashlib.sha256(tokenizer.to_str().encode("utf-8"))
    h.update(str(dtype).encode())
    for name in sorted(docs):
        h.update(b"\x00split\x00" + name.encode("utf-8"))
        for d in docs[name]:
            h.update(b"\x00doc\x00" + d.text.encode("utf-8"))
    return h.hexdigest()[:20]
