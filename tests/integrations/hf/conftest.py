"""Fixtures of the plsh train-hf tests: a few documents of the shipped corpus as text files, and a 300-token BPE
trained on them (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from positional_lsh.lm import data as D


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    docs = D.load_corpus()
    for i, d in enumerate(docs[:4] + docs[20:26]):
        (root / f"doc{i:02d}.txt").write_text(d.text[:5000], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tok_file(text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    splits = D.load_splits(str(text_dir))
    return D.train_tokenizer(splits["train"], 300).save(tmp_path_factory.mktemp("tok") / "tokenizer.json")
