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


def issue_sweep(length: int) -> list[R.EvalRow]:
    """The plsh-t1 model's sweep at ``length`` as docs/experiments.md reports it (ppl, cost per query): at L = 256,
    T = 16 samples cost 553 entries per query, and its "equal-cost" window is exact ALiBi's 128.5 (issue 34, item 7)."""
    table = {
        256: ([(1, 151.89, 35), (4, 154.20, 138), (16, 156.77, 553), (64, 158.23, 2213)],
              [(1, 149.16, 34.4), (4, 158.58, 78), (16, 158.67, 111), (64, 158.67, 128.5)], 158.67),
        1024: ([(1, 151.07, 55), (4, 152.62, 219), (16, 155.32, 875), (64, 156.77, 3498)],
               [(1, 147.48, 54.2), (4, 157.25, 181), (16, 157.44, 321), (64, 157.44, 443)], 157.44),
    }  # fmt: skip
    plsh, window, exact = table[length]
    rows = [row("plsh-t1", "alibi", 256, length, exact)]
    rows[0].cost_per_query = (length + 1) / 2
    for (t, ppl, cost), (_, wppl, wcost) in zip(plsh, window, strict=True):
        rows.append(row("plsh-t1", "plsh", 256, length, ppl, samples=t, scheme="discrete"))
        rows[-1].cost_per_query = cost
        rows.append(row("plsh-t1", "window", 256, length, wppl, samples=t))
        rows[-1].cost_per_query = wcost
    return rows


def test_sweep_marks_capped_windows_and_where_plsh_is_never_cheaper(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 34, item 7: sweep.png labelled every window "equal cost", though at L = 256 the window of T = 16 is
    exact ALiBi at 128.5 entries per query against T = 16's 553. A window that could not reach its T's cost is drawn
    hollow, and the T from which positional LSH costs at least exact attention are shaded and named."""
    rows = issue_sweep(256) + issue_sweep(1024)
    sweep = [r for r in rows if r.kind in ("plsh", "window")]
    capped = R.capped_windows(sweep)
    assert sorted((r.eval_len, r.samples) for r in sweep if id(r) in capped) == [
        (256, 4), (256, 16), (256, 64), (1024, 4), (1024, 16), (1024, 64)
    ]  # fmt: skip  # T = 1's windows are 34.4 / 54.2 against 35 / 55: the rounding of an integer window
    assert R.never_cheaper([r for r in sweep if r.eval_len == 256]) == 4  # 138 >= 128.5
    assert R.never_cheaper([r for r in sweep if r.eval_len == 1024]) == 16  # 219 < 512.5 <= 875
    figure = drawn_figures(monkeypatch, rows, tmp_path)["sweep.png"]
    for ax, first in zip(sorted(figure.axes, key=lambda a: a.get_title()), (16, 4), strict=True):  # L=1024, L=256
        labels = ax.get_legend_handles_labels()[1]
        assert "windowed ALiBi, equal cost" not in labels
        hollow = [line for line in ax.get_lines() if line.get_label().startswith("window capped")]
        assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [4, 16, 64], ax.get_title()
        assert any(label.startswith(f"T >= {first}: sampled plsh costs >= exact") for label in labels), labels


def test_a_scheme_whose_cost_does_not_grow_with_t_does_not_hide_where_plsh_costs_more() -> None:
    """The ALiBi-trained model's sweep as docs/experiments.md reports it (costs per query; its windows' in the
    comment): ``fixed`` costs 48 at every T (identical samples, computed once), ``discrete`` and ``gamma`` grow."""
    rows = []
    for length, costs in ((256, (35, 138, 553, 2213)), (1024, (55, 219, 875, 3498)), (4096, (63, 252, 1008, 4030))):
        for t, cost in zip((1, 4, 16, 64), costs, strict=True):
            for scheme in ("discrete", "gamma", "fixed"):
                rows.append(row("alibi", "plsh", 256, length, 150.0, samples=t, scheme=scheme))
                rows[-1].cost_per_query = 48.0 if scheme == "fixed" else float(cost)
    windows = {256: (34.4, 78, 111, 128.5), 1024: (54.3, 181, 321, 443), 4096: (62.2, 251.4, 757, 1285)}
    for length, costs in windows.items():
        for t, cost in zip((1, 4, 16, 64), costs, strict=True):
            rows.append(row("alibi", "window", 256, length, 130.0, samples=t))
            rows[-1].cost_per_query = cost
    assert [R.never_cheaper([r for r in rows if r.eval_len == n]) for n in (256, 1024, 4096)] == [4, 16, 64]
    capped = R.capped_windows(rows)
    assert sorted((r.eval_len, r.samples) for r in rows if id(r) in capped) == [
        (256, 4), (256, 16), (256, 64), (1024, 4), (1024, 16), (1024, 64), (4096, 16), (4096, 64)
    ]  # fmt: skip  # at L = 4096 the window of T = 4 costs 251.4 against 252: not capped


def test_sweep_without_capped_windows_marks_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = [r for r in issue_sweep(1024) if r.samples in (None, 1)]
    (ax,) = drawn_figures(monkeypatch, rows, tmp_path)["sweep.png"].axes
    labels = ax.get_legend_handles_labels()[1]
    assert not any(label.startswith(("window capped", "T >=")) for label in labels), labels


def test_loss_by_position_drops_and_marks_thin_buckets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 34, item 7: with a stride below the window, only the first window scores the early positions, so the
    plot mixed buckets of 16-32 tokens with buckets of 2,480 and showed their noise as spikes. Thin buckets are not
    drawn; their positions are shaded, and every line says how many tokens each of its points holds."""
    r = row("alibi", "own", 512, 2048, 100.0)
    counts = [16, 32] * 6 + [2480] * 4  # positions below L - stride = 1536: the first window's tokens only
    r.loss_by_position = [R.PositionBucket(k * 128, (k + 1) * 128, 5.6 if c < 100 else 4.3, c)
                          for k, c in enumerate(counts)]  # fmt: skip
    assert R.thin_buckets(r.loss_by_position) == [c < 248 for c in counts]
    (ax,) = drawn_figures(monkeypatch, [r], tmp_path)["loss_by_position.png"].axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [(k * 128 + (k + 1) * 128 - 1) / 2 for k in range(12, 16)]
    assert list(line.get_ydata()) == [4.3] * 4  # no 5.6 spike
    assert "(2,480 tok/point)" in line.get_label()
    shade = [p for p in ax.patches if p.get_label() == "not drawn: <= 32 tokens per bucket"]
    assert len(shade) == 1 and len(ax.patches) == 12  # one shaded span per thin bucket, one legend entry
