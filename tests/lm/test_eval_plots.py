"""The plots and cost column of ``plsh eval``: no empty panel, no matplotlib warning, plain tick labels, and one cost
model for a model's own positional-LSH attention and the sweep's."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import matplotlib
import pytest
import torch

from positional_lsh.lm import data as D
from positional_lsh.lm import eval_results as R
from positional_lsh.lm import evaluate as E
from positional_lsh.lm.eval_models import HFAttention

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def row(model: str, kind: str, train_len: int, eval_len: int, ppl: float, **kw: Any) -> R.EvalRow:
    attention = {"own": "own: alibi", "alibi": "exact ALiBi"}.get(kind, f"{kind} T={kw.get('samples')}")
    return R.EvalRow(model=model, attention=attention, kind=kind, train_len=train_len, eval_len=eval_len,
                     factor=eval_len / train_len, stride=train_len, samples=kw.get("samples"), scheme=kw.get("scheme"),
                     loss=1.0, ppl=ppl, bits_per_token=1.0, top1=0.1, top10=0.5, tokens=100, seconds=1.0)  # fmt: skip


def two_lengths() -> list[R.EvalRow]:
    """Model a trained at 16 (swept at 16, 32), model b at 64 (swept at 64 only): different evaluation lengths."""
    rows = []
    for model, tl, lengths in (("a", 16, (16, 32)), ("b", 64, (64,))):
        for n in lengths:
            rows.append(row(model, "own", tl, n, 96.7 + n / 64))
            for t in (1, 4):
                rows.append(row(model, "plsh", tl, n, 110.0 - t, samples=t, scheme="discrete"))
                rows.append(row(model, "window", tl, n, 105.0 - t, samples=t))
    return rows


def drawn_figures(monkeypatch: pytest.MonkeyPatch, rows: list[R.EvalRow], tmp_path: Path) -> dict[str, Any]:
    """``plot_results(rows)``'s figures by file name, drawn, kept open (``plt.close`` recorded instead)."""
    figures: dict[str, Any] = {}

    def keep(fig: Any) -> None:
        figures[Path(fig.get_label() or "").name] = fig

    def savefig(fig: Any, path: Any, *args: Any, **kw: Any) -> None:
        fig.set_label(str(path))
        fig.canvas.draw()

    monkeypatch.setattr(plt, "close", keep)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "No artists with labels found to put in legend" and any other
        R.plot_results(rows, tmp_path)
    return figures


def test_sweep_plot_has_no_empty_panel_for_models_trained_at_different_lengths(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    figures = drawn_figures(monkeypatch, two_lengths(), tmp_path)
    sweep = figures["sweep.png"]
    titles = sorted(ax.get_title() for ax in sweep.axes)
    assert titles == ["a, L=16", "a, L=32", "b, L=64"]  # one panel per (model, length) with data, no other
    for ax in sweep.axes:
        assert ax.get_lines(), ax.get_title()
        assert ax.get_legend() is not None


PLAIN = re.compile(r"^\d+(\.\d+)?$")


@pytest.mark.parametrize("ppls", [(96.1, 97.3, 99.0), (96.75,), (12.0, 350.0, 4100.0), (1.5, 1.9)])
def test_extrapolation_plot_has_plain_tick_labels(
    ppls: tuple[float, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = [row("a", "own", 16, 16 * 2**i, p) for i, p in enumerate(ppls)]
    (ax,) = drawn_figures(monkeypatch, rows, tmp_path)["extrapolation.png"].axes
    lo, hi = ax.get_ylim()
    shown = [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
    labels = [text for y, text in shown if lo <= y <= hi and text]
    assert len(labels) >= 2, shown  # the axis is readable ...
    assert all(PLAIN.match(text) for text in labels), labels  # ... in plain numbers: no "9.675×10^1"
    for y, text in shown:
        if text:
            assert float(text) == pytest.approx(y, rel=1e-6)


def test_own_plsh_swap_costs_as_the_sweep_row_of_its_t(tmp_path: Path) -> None:
    """A transformers model scored with its own positional-LSH swap: its own row's cost per query is the sweep
    row's for the same T and scheme (expected score entries of T samples), not exact attention's (L + 1) / 2; an
    own windowed-ALiBi swap's is its window's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("positional_lsh.integrations.hf")
    data = tmp_path / "data"
    docs = D.load_corpus()
    for split, chosen in (("train", docs[:2]), ("validation", docs[10:11]), ("test", docs[11:13])):
        (data / split).mkdir(parents=True)
        for i, d in enumerate(chosen):
            (data / split / f"{i}.txt").write_text(d.text[:3000], encoding="utf-8")
    tok_file = D.train_tokenizer(D.load_splits(str(data))["train"], 300).save(tmp_path / "tok")
    vocab = D.BPETokenizer.load(tok_file).vocab_size
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=vocab, n_layer=1, n_head=4, hidden_size=32)
    transformers.BloomForCausalLM(cfg).save_pretrained(tmp_path / "bloom")
    kw = dict(data=str(data), split="test", train_len=64, tokenizer=str(tok_file),
              cache_dir=None, seed=0, device=torch.device("cpu"))  # fmt: skip
    attention = HFAttention(position="plsh", num_samples=4, scheme="discrete")
    adapter, stream = E.load_for_eval(tmp_path / "bloom", label="bloom", attention=attention, **kw)
    rows = E.evaluate_model(adapter, stream, factors=(1,), max_tokens=200, samples=(4,), schemes=("discrete",),
                            equal_cost=False, progress=False)  # fmt: skip
    by = {r.kind: r for r in rows}
    assert by["own"].cost_per_query is not None and by["plsh"].cost_per_query is not None
    assert by["own"].cost_per_query == pytest.approx(by["plsh"].cost_per_query, rel=1e-12)
    assert by["own"].cost_per_query != pytest.approx((64 + 1) / 2)

    attention = HFAttention(position="window-alibi", window=5)
    adapter, stream = E.load_for_eval(tmp_path / "bloom", label="bloom", attention=attention, **kw)
    rows = E.evaluate_model(adapter, stream, factors=(1,), max_tokens=200, samples=(), progress=False)
    assert rows[0].kind == "own"
    assert rows[0].cost_per_query == pytest.approx(E.window_cost(5, 64) / 64)
