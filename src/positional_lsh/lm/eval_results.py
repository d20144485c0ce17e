"""Results of ``plsh eval``: :class:`EvalRow`, the Markdown table, ``results.csv`` / ``results.md``,
``loss_by_position.csv``, the learned slopes of models trained with them (:class:`LearnedSlopes`, ``slopes.csv``)
and plots."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PositionBucket:
    """Mean loss of the scored tokens whose position inside the window that scored them is in ``[start, end)``."""

    start: int  # first position of the bucket (0-based, inclusive)
    end: int  # one past its last position (exclusive)
    mean_loss: float  # mean cross-entropy (nats) of the bucket's scored tokens
    count: int  # scored tokens in the bucket


@dataclass
class EvalRow:
    """One evaluation: a model, an attention variant, an evaluation length.

    ``mrr`` (mean reciprocal rank of the target token) and ``entropy`` (mean predictive entropy, nats) are
    ``None`` in rows read from a ``results.csv`` written before they existed. ``loss_by_position`` (mean loss per
    bucket of position within the window) is not a ``results.csv`` column: it goes to ``loss_by_position.csv``.
    """

    model: str
    attention: str
    kind: str  # "own", "alibi", "plsh", "window"
    train_len: int
    eval_len: int
    factor: float
    stride: int
    samples: int | None
    scheme: str | None
    loss: float
    ppl: float
    bits_per_token: float
    top1: float
    top10: float
    tokens: int
    seconds: float
    cost_per_query: float | None = None  # causal score entries per query per head (mean over heads)
    mrr: float | None = None  # mean reciprocal rank of the target token (ties count in its favour)
    entropy: float | None = None  # mean entropy of the predicted next-token distribution, nats
    loss_by_position: list[PositionBucket] = field(default_factory=list, repr=False)


_COLUMNS = [f.name for f in dataclasses.fields(EvalRow) if f.name != "loss_by_position"]
# loss_by_position.csv, long format: one line per (row, position bucket)
POSITION_COLUMNS = ["model", "attention", "kind", "factor", "eval_len", "pos_start", "pos_end", "mean_loss", "count"]


@dataclass
class LearnedSlopes:
    """The learned ALiBi slopes of one evaluated model (``ModelConfig.learn_slopes``).

    Attributes:
        model: the model's label in the tables.
        slopes: ``slopes[layer][head]``, the learned slope ``m = exp(log_slopes)`` of each layer and head.
        initial: ``initial[head]``, the slopes they started from (``ModelConfig.slopes()``).
    """

    model: str
    slopes: list[list[float]]
    initial: list[float]


SLOPE_COLUMNS = ["model", "layer", "head", "slope", "initial_slope"]
"""``slopes.csv``, long format: one line per (model, layer, head)."""


def format_slopes(learned: LearnedSlopes) -> str:
    """A Markdown table of one model's learned slopes: a row per layer, a column per head, after a row of the
    slopes they started from."""
    heads = len(learned.initial)
    lines = [f"learned slopes of {learned.model} (m_h, bias -m_h |i - j|):",
             "| layer | " + " | ".join(f"h{h}" for h in range(heads)) + " |",
             "|---|" + "---:|" * heads,
             "| start | " + " | ".join(f"{m:.4g}" for m in learned.initial) + " |"]  # fmt: skip
    lines += [f"| {layer} | " + " | ".join(f"{m:.4g}" for m in row) + " |" for layer, row in enumerate(learned.slopes)]
    return "\n".join(lines)


def write_slopes(slopes: Sequence[LearnedSlopes], path: str | os.PathLike[str]) -> Path:
    """Write ``slopes.csv`` (:data:`SLOPE_COLUMNS`) at ``path``; returns it."""
    path = Path(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SLOPE_COLUMNS)
        w.writeheader()
        for ls in slopes:
            for layer, row in enumerate(ls.slopes):
                for head, m in enumerate(row):
                    w.writerow({"model": ls.model, "layer": layer, "head": head, "slope": m,
                                "initial_slope": ls.initial[head]})  # fmt: skip
    return path


def read_slopes(path: str | os.PathLike[str]) -> list[LearnedSlopes]:
    """Read a ``slopes.csv`` written by :func:`write_results` back, one :class:`LearnedSlopes` per model."""
    table: dict[str, dict[tuple[int, int], float]] = {}
    initial: dict[str, dict[int, float]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for rec in csv.DictReader(f):
            layer, head = int(rec["layer"]), int(rec["head"])
            table.setdefault(rec["model"], {})[(layer, head)] = float(rec["slope"])
            initial.setdefault(rec["model"], {})[head] = float(rec["initial_slope"])
    out = []
    for model, cells in table.items():
        layers, heads = max(k[0] for k in cells) + 1, max(k[1] for k in cells) + 1
        out.append(LearnedSlopes(model, [[cells[(layer, h)] for h in range(heads)] for layer in range(layers)],
                                 [initial[model][h] for h in range(heads)]))  # fmt: skip
    return out


def format_table(rows: Sequence[EvalRow]) -> str:
    """A Markdown table of the rows."""
    head = ["model", "attention", "L", "L/train", "loss", "ppl", "MRR", "entropy", "bits/tok", "top-1", "top-10",
            "cost/query", "s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        cost = "" if r.cost_per_query is None else f"{r.cost_per_query:.1f}"
        mrr = "" if r.mrr is None else f"{r.mrr:.4f}"
        entropy = "" if r.entropy is None else f"{r.entropy:.4f}"
        cells = [r.model, r.attention, str(r.eval_len), f"{r.factor:g}x", f"{r.loss:.4f}", f"{r.ppl:.2f}", mrr,
                 entropy, f"{r.bits_per_token:.3f}", f"{r.top1:.4f}", f"{r.top10:.4f}", cost,
                 f"{r.seconds:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    rows: Sequence[EvalRow],
    out_dir: str | os.PathLike[str],
    *,
    plots: bool = True,
    slopes: Sequence[LearnedSlopes] = (),
) -> list[Path]:
    """Write ``results.csv`` (one line per row), ``loss_by_position.csv`` (long format, :data:`POSITION_COLUMNS`:
    one line per row and position bucket), ``results.md`` and (``plots``) the PNG plots of :func:`plot_results`.
    With ``slopes`` (the models trained with learned slopes): also ``slopes.csv`` (:func:`write_slopes`), and their
    tables (:func:`format_slopes`) at the end of ``results.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: getattr(r, k) for k in _COLUMNS})
    written.append(out / "results.csv")
    with open(out / "loss_by_position.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=POSITION_COLUMNS)
        w.writeheader()
        for r in rows:
            for b in r.loss_by_position:
                w.writerow({"model": r.model, "attention": r.attention, "kind": r.kind, "factor": r.factor,
                            "eval_len": r.eval_len, "pos_start": b.start, "pos_end": b.end,
                            "mean_loss": b.mean_loss, "count": b.count})  # fmt: skip
    written.append(out / "loss_by_position.csv")
    md = format_table(rows) + "\n"
    if slopes:
        md += "".join("\n" + format_slopes(ls) + "\n" for ls in slopes)
        written.append(write_slopes(slopes, out / "slopes.csv"))
    (out / "results.md").write_text(md, encoding="utf-8")
    written.append(out / "results.md")
    if plots:
        written += plot_results(rows, out)
    return written


def read_results(path: str | os.PathLike[str]) -> list[EvalRow]:
    """Read rows back from a ``results.csv``; their ``loss_by_position`` from the ``loss_by_position.csv`` next to
    it, when there is one (:func:`read_loss_by_position`). Columns added since a file was written get defaults."""
    rows = []
    types = {f.name: f.type for f in dataclasses.fields(EvalRow)}
    with open(path, newline="", encoding="utf-8") as f:
        for rec in csv.DictReader(f):
            kw: dict[str, Any] = {}
            for k, v in rec.items():
                t = str(types[k])
                if v == "":
                    kw[k] = None
                elif "int" in t and "float" not in t:
                    kw[k] = int(v)
                elif "float" in t:
                    kw[k] = float(v)
                else:
                    kw[k] = v
            rows.append(EvalRow(**kw))
    positions = Path(path).with_name("loss_by_position.csv")
    if positions.is_file():
        read_loss_by_position(positions, rows)
    return rows


def read_loss_by_position(path: str | os.PathLike[str], rows: Sequence[EvalRow]) -> None:
    """Attach the buckets of a ``loss_by_position.csv`` to ``rows`` (the rows of the ``results.csv`` it was
    written with): the n-th group of lines with a (model, attention, kind, factor, L) goes to the n-th such row."""
    groups: dict[tuple[str, str, str, float, int], list[list[PositionBucket]]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        last: tuple[str, str, str, float, int] | None = None
        last_start = -1
        for rec in csv.DictReader(f):
            key = (rec["model"], rec["attention"], rec["kind"], float(rec["factor"]), int(rec["eval_len"]))
            b = PositionBucket(int(rec["pos_start"]), int(rec["pos_end"]), float(rec["mean_loss"]), int(rec["count"]))
            if key != last or b.start <= last_start:  # a row's buckets are consecutive lines, in position order
                groups.setdefault(key, []).append([])
            groups[key][-1].append(b)
            last, last_start = key, b.start
    seen: dict[tuple[str, str, str, float, int], int] = {}
    for r in rows:
        key = (r.model, r.attention, r.kind, float(r.factor), int(r.eval_len))
        n = seen.get(key, 0)
        seen[key] = n + 1
        if n < len(groups.get(key, [])):
            r.loss_by_position = groups[key][n]


def plot_results(rows: Sequence[EvalRow], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``extrapolation.png`` (perplexity vs L / training length, one line per model and attention, without the
    sweep), ``sweep.png`` (perplexity vs T per evaluation length: schemes, equal-cost windowed ALiBi and exact
    ALiBi; only with sweep rows) and ``loss_by_position.png`` (mean loss vs position within the window, one panel
    per L / training length, one line per model and attention without the sweep; only when the rows have
    ``loss_by_position``); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_plot_extrapolation(plt, rows, out / "extrapolation.png")]
    sweep = [r for r in rows if r.kind in ("plsh", "window")]
    if sweep:
        written.append(_plot_sweep(plt, rows, sweep, out / "sweep.png"))
    positions = [r for r in rows if r.loss_by_position and r.kind in ("own", "alibi")]
    if positions:
        written.append(_plot_loss_by_position(plt, positions, out / "loss_by_position.png"))
    return written


def _plot_extrapolation(plt: Any, rows: Sequence[EvalRow], path: Path) -> Path:
    """Perplexity vs evaluation length / training length, one line per (model, attention) outside the sweep."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: dict[tuple[str, str], list[EvalRow]] = {}
    for r in rows:
        if r.kind in ("own", "alibi"):
            curves.setdefault((r.model, r.attention), []).append(r)
    for (model, att), rs in curves.items():
        rs = sorted(rs, key=lambda r: r.factor)
        ax.plot([r.factor for r in rs], [r.ppl for r in rs], marker="o", label=f"{model} — {att}")
    ax.set_yscale("log")
    _plain_log_ticks(ax.yaxis, [r.ppl for rs in curves.values() for r in rs])
    _style_axes(ax, "Length extrapolation", "evaluation length / training length", "perplexity (sliding window)", 7)
    return _save(plt, fig, path)


def _sample_count(row: EvalRow) -> int:
    """``T`` of a ``"plsh"`` or ``"window"`` row, the x axis of the sweep plot (always set for those kinds)."""
    if row.samples is None:
        raise ValueError(f"the {row.kind!r} row {row.attention!r} has no sample count")
    return row.samples


def exact_cost(length: int) -> float:
    """Causal score entries per query of exact attention at ``length``: ``(L + 1) / 2`` (the rows' cost model)."""
    return (length + 1) / 2


def capped_windows(rows: Sequence[EvalRow]) -> set[int]:
    """The ``id`` of each ``"window"`` row whose window could not match the cost of its ``T`` samples: the window
    is capped at the whole sequence (exact ALiBi, ``(L + 1) / 2`` entries per query) for every head or some, so it
    costs less than its ``T``. Its target is the ``discrete`` positional-LSH row of the same model, length and ``T``
    (the window matches that scheme's expected cost); without one, a window at exact attention's cost is capped.
    A window below its target by less than one entry per query is not: that is the rounding of an integer window
    (each head's window is the largest whose cost fits, and one more position costs under one entry per query)."""
    target = {(r.model, r.eval_len, r.samples): r.cost_per_query for r in rows
              if r.kind == "plsh" and r.scheme == "discrete" and r.cost_per_query is not None}  # fmt: skip
    out = set()
    for r in rows:
        if r.kind != "window" or r.cost_per_query is None:
            continue
        goal = target.get((r.model, r.eval_len, r.samples))
        whole = r.cost_per_query >= exact_cost(r.eval_len) * (1 - 1e-9)
        if (goal is not None and r.cost_per_query < goal - 1.0) or (goal is None and whole):
            out.add(id(r))
    return out


def never_cheaper(rows: Sequence[EvalRow]) -> int | None:
    """The smallest ``T`` from which every positional-LSH row of ``rows`` (one model and length) whose cost grows with
    ``T`` costs at least as much as exact attention (``(L + 1) / 2`` score entries per query): the sweep is never
    cheaper from there on. A scheme whose rows cost the same at every ``T`` (``fixed``: its identical samples are
    computed once) does not count. ``None`` when some row at the largest ``T`` is cheaper, or no row has a cost."""
    costs: dict[str | None, dict[int, float]] = {}
    for r in rows:
        if r.kind == "plsh" and r.samples is not None and r.cost_per_query is not None:
            costs.setdefault(r.scheme, {})[r.samples] = r.cost_per_query
    by_t: dict[int, list[float]] = {}
    for by_samples in costs.values():
        if len(by_samples) > 1 and len(set(by_samples.values())) == 1:
            continue  # its cost does not grow with T
        for t, cost in by_samples.items():
            by_t.setdefault(t, []).append(cost)
    first = None
    for t in sorted(by_t, reverse=True):
        if min(by_t[t]) < exact_cost(rows[0].eval_len):
            break
        first = t
    return first


def _plot_sweep(plt: Any, rows: Sequence[EvalRow], sweep: list[EvalRow], path: Path) -> Path:
    """One panel per (model, evaluation length) that has sweep rows: perplexity vs T per scheme, equal-cost
    windows, exact ALiBi. A row of panels per model; models trained at different lengths have different
    evaluation lengths, so a row holds only its model's lengths, and no panel is left empty.

    A window capped at the whole sequence (:func:`capped_windows`: it costs less than its ``T``) is drawn hollow,
    and the ``T`` from which positional LSH costs at least as much as exact attention (:func:`never_cheaper`) on
    are shaded: there a sweep point is not a cheaper approximation."""
    models = list(dict.fromkeys(r.model for r in sweep))
    lengths = {model: sorted({r.eval_len for r in sweep if r.model == model}) for model in models}
    capped = capped_windows(sweep)
    cols = max(len(ls) for ls in lengths.values())
    fig, axes = plt.subplots(len(models), cols, figsize=(3.6 * cols, 3.2 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j in range(len(lengths[model]), cols):
            axes[i][j].remove()  # this model has fewer evaluation lengths than the widest row
        for j, length in enumerate(lengths[model]):
            ax = axes[i][j]
            sub = [r for r in sweep if r.model == model and r.eval_len == length]
            for scheme in dict.fromkeys(r.scheme for r in sub if r.kind == "plsh"):
                pts = sorted((r for r in sub if r.kind == "plsh" and r.scheme == scheme), key=_sample_count)
                ax.plot([r.samples for r in pts], [r.ppl for r in pts], marker="o", label=f"plsh {scheme}")
            pts = sorted((r for r in sub if r.kind == "window"), key=_sample_count)
            if pts:
                (line,) = ax.plot([r.samples for r in pts], [r.ppl for r in pts], marker="s",
                                  label="windowed ALiBi, cost of T")  # fmt: skip
                hollow = [r for r in pts if id(r) in capped]
                if hollow:
                    ax.plot([r.samples for r in hollow], [r.ppl for r in hollow], ls="none", marker="s", ms=9,
                            mfc="white", mec=line.get_color(), label="window capped at L: cheaper than T")  # fmt: skip
            exact = [r for r in rows if r.model == model and r.eval_len == length and _is_exact_alibi(r)]
            if exact:
                ax.axhline(exact[0].ppl, color="k", ls="--", lw=1, label="exact ALiBi")
            first = never_cheaper(sub)
            if first is not None:
                top = max(r.samples for r in sub if r.samples is not None)
                label = f"T >= {first}: sampled plsh costs >= exact ({exact_cost(length):g}/query)"
                ax.axvspan(first / 2**0.25, top * 2**0.25, color="0.5", alpha=0.15, lw=0, label=label)
            _style_axes(ax, f"{model}, L={length}", "T (windows: the cost of T samples)", "perplexity", 6,
                        title_size=9)  # fmt: skip
    return _save(plt, fig, path)


THIN_BUCKET_SHARE = 0.1
"""A position bucket with fewer scored tokens than this share of its row's fullest bucket is *thin*: its mean loss
is noise (16-32 tokens against 2,480 with a stride below the window, where only the first window scores the early
positions). ``loss_by_position.png`` does not draw it; it shades its positions instead."""


def thin_buckets(buckets: Sequence[PositionBucket]) -> list[bool]:
    """Whether each bucket is thin (:data:`THIN_BUCKET_SHARE` of the fullest bucket's scored tokens)."""
    most = max((b.count for b in buckets), default=0)
    return [b.count < THIN_BUCKET_SHARE * most for b in buckets]


def _plot_loss_by_position(plt: Any, rows: Sequence[EvalRow], path: Path) -> Path:
    """One panel per evaluation length / training length: mean loss vs position within the window (bucket
    centres), one line per (model, attention), labelled with its tokens per point. Thin buckets
    (:func:`thin_buckets`) are not drawn: their positions are shaded and the legend says how few tokens they hold."""
    factors = sorted({r.factor for r in rows})
    fig, axes = plt.subplots(1, len(factors), figsize=(4.2 * len(factors), 3.6), squeeze=False)
    for ax, factor in zip(axes[0], factors, strict=True):
        sub = [r for r in rows if r.factor == factor]
        shaded: dict[tuple[int, int], int] = {}  # thin positions [start, end) -> the most tokens such a bucket holds
        for r in sub:
            thin = thin_buckets(r.loss_by_position)
            kept = [b for b, t in zip(r.loss_by_position, thin, strict=True) if not t]
            for b, t in zip(r.loss_by_position, thin, strict=True):
                if t:
                    shaded[(b.start, b.end)] = max(shaded.get((b.start, b.end), 0), b.count)
            xs = [(b.start + b.end - 1) / 2 for b in kept]
            counts = sorted({b.count for b in kept})
            per_point = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}-{counts[-1]:,}"
            ax.plot(xs, [b.mean_loss for b in kept], marker=".",
                    label=f"{r.model} — {r.attention} ({per_point} tok/point)")  # fmt: skip
        for k, (start, end) in enumerate(sorted(shaded)):
            label = f"not drawn: <= {max(shaded.values()):,} tokens per bucket" if k == 0 else None
            ax.axvspan(start - 0.5, end - 0.5, color="0.5", alpha=0.15, lw=0, label=label)
        lengths = "/".join(str(n) for n in sorted({r.eval_len for r in sub}))
        _style_axes(ax, f"{factor:g}x (L={lengths})", "position within the window", "mean loss (nats)", 6,
                    title_size=9, log_x=False)  # fmt: skip
    return _save(plt, fig, path)


def _is_exact_alibi(r: EvalRow) -> bool:
    return r.kind == "alibi" or (r.kind == "own" and r.attention.startswith("own: alibi"))


def _style_axes(
    ax: Any,
    title: str,
    xlabel: str,
    ylabel: str,
    legend_size: int,
    *,
    title_size: int | None = None,
    log_x: bool = True,
) -> None:
    """Log2 x axis (``log_x``), labels, grid and legend, as the plots draw them."""
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))  # else the axes' title size
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # else matplotlib warns "No artists with labels found"
        ax.legend(fontsize=legend_size)


def _plain_log_ticks(axis: Any, values: Sequence[float]) -> None:
    """Plain tick labels (``90``, ``100``, ``200``: no ``9.675×10^1``) on a log-scaled axis showing ``values``.

    Spanning a decade or more, the ticks are the 1-2-5 numbers of each decade; spanning less, they are about six
    evenly spaced round numbers (a log axis inside one decade has no major tick, and matplotlib then labels
    the minor ones in scientific notation). Minor ticks carry no label."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    finite = [v for v in values if math.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) >= 10:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        axis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.6f}".rstrip("0").rstrip(".")))  # 100, 96.5
    axis.set_minor_formatter(NullFormatter())


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
