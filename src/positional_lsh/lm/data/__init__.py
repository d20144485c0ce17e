"""Data for language-model training and evaluation: corpus, tokenizer, token streams and windows.

* :mod:`~positional_lsh.lm.data.corpus`: documents — the shipped corpus (``load_corpus``, ``corpus_splits``),
  your own text (``load_text_files``), Hugging Face datasets (``load_hf_dataset``), splits by document
  (``split_documents``) and one source string for all of them (``load_splits``).
* :mod:`~positional_lsh.lm.data.tokenizer`: the byte-level BPE tokenizer (``BPETokenizer``,
  ``train_tokenizer``, ``load_tokenizer``) and token streams (``encode_documents``, ``encode_splits``).
* :mod:`~positional_lsh.lm.data.windows`: ``(inputs, targets)`` windows (``random_batch``,
  ``random_windows``, ``sliding_windows``, ``num_sliding_windows``).

Nothing here downloads: the corpus ships with the package and the tokenizer is trained locally.
Every public name is re-exported here, so ``from positional_lsh.lm import data as D; D.load_corpus()`` works.
"""

from positional_lsh.lm.data.corpus import (
    SPLITS,
    Document,
    corpus_splits,
    load_corpus,
    load_hf_dataset,
    load_splits,
    load_text_files,
    split_by_position,
    split_documents,
)
from positional_lsh.lm.data.tokenizer import (
    EOD_TOKEN,
    BPETokenizer,
    encode_documents,
    encode_splits,
    load_tokenizer,
    train_tokenizer,
)
from positional_lsh.lm.data.windows import num_sliding_windows, random_batch, random_windows, sliding_windows

__all__ = [
    "EOD_TOKEN",
    "SPLITS",
    "BPETokenizer",
    "Document",
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
    "split_by_position",
    "split_documents",
    "train_tokenizer",
]
