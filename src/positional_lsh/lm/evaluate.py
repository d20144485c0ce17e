"""``plsh eval``: sliding-window perplexity at and beyond the training length, and the positional-LSH sweep.

Protocol (the ALiBi paper's sliding-window evaluation, as the positional-LSH paper ran it): the evaluation split
is one token stream (documents joined by the end-of-document token); windows of ``L`` tokens start every
``stride`` tokens (default: the training length), and each window scores only the tokens no earlier window
scored, so every token after the first is scored exactly once, with at least ``L - stride`` tokens of context
(:func:`positional_lsh.lm.data.sliding_windows`). ``L`` runs over multiples of the training length (1x, 2x, 4x,
8x, 16x). Metrics over the scored tokens: mean cross-entropy (nats), perplexity, bits per token, top-1 and
top-10 accuracy.

Attention variants evaluated for each model:

* the model's own attention (``own``) at every length;
* for ALiBi- and positional-LSH-trained models: exact ALiBi (for a positional-LSH model this is the
  ``T -> infinity`` limit of its own attention) at every length, then the **sweep**: positional-LSH attention
  with ``T`` samples (1, 4, 16, 64) for each scheme (``discrete``, ``gamma``, ``fixed``), and windowed ALiBi
  at **equal cost** for each ``T``: per head, the window whose causal score-entry count equals the expected
  count of ``T`` positional-LSH samples of the ``discrete`` scheme at that length (:func:`equal_cost_window`).

Models: this library's checkpoints (:func:`positional_lsh.lm.model.load_checkpoint`) and local transformers
checkpoints (a ``save_pretrained`` folder, via :func:`positional_lsh.integrations.hf.load_local_model`): their own
attention, and for native ALiBi models (BLOOM, MPT, Falcon with ``alibi=True``) the library's exact ALiBi,
the positional-LSH sweep and windowed ALiBi through the ``positional_lsh.integrations.hf`` swaps.

Results: a table on stdout, ``results.csv``, ``results.md`` and PNG plots (perplexity vs evaluation length;
perplexity vs ``T``) in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from positional_lsh.lm import data as D
from positional_lsh.lm.model import TransformerLM, is_checkpoint, load_checkpoint, shipped_checkpoint_path
from positional_lsh.ops.sampling import SCHEMES, sample_partitions

__all__ = [
    "EvalRow",
    "ShippedDemo",
    "equal_cost_window",
    "evaluate_model",
    "expected_plsh_cost",
    "register_cli",
    "shipped_checkpoint_path",
    "shipped_model_demo",
    "sliding_window_metrics",
    "window_cost",
    "write_results",
]

DEFAULT_FACTORS = (1, 2, 4, 8, 16)
DEFAULT_SAMPLES = (1, 4, 16, 64)
DEFAULT_SCHEMES = ("discrete", "gamma", "fixed")

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def sliding_window_metrics(
    logits_fn: LogitsFn,
    tokens: torch.Tensor,
    seq_len: int,
    stride: int | None = None,
    *,
    batch_size: int = 1,
    device: torch.device | str | None = None,
    progress: bool = False,
    desc: str = "eval",
) -> dict[str, float]:
    """Sliding-window metrics of a causal LM on one token stream.

    Args:
        logits_fn: maps ``(b, seq_len)`` int64 ids to ``(b, seq_len, V)`` next-token logits.
        tokens: 1-D integer token stream of at least ``seq_len + 1`` tokens.
        seq_len: window length ``L``.
        stride: window step (default ``L``: disjoint windows); each window scores only its new tokens.
        batch_size: windows per call of ``logits_fn``.
        device: where to put the ids (default: CPU).

    Returns:
        ``{"loss", "ppl", "bits_per_token", "top1", "top10", "tokens", "windows", "seconds"}``: mean
        cross-entropy in nats over the scored tokens, ``exp(loss)``, ``loss / ln 2``, top-1 / top-10 accuracy,
        the number of scored tokens (``len(tokens) - 1``) and of windows.
    """
    if not callable(logits_fn):
        raise TypeError(f"logits_fn must be callable, got {type(logits_fn).__name__}")
    n_windows = D.num_sliding_windows(int(tokens.numel()) if isinstance(tokens, torch.Tensor) else 0, seq_len, stride)
    nll = 0.0
    correct1 = correct10 = count = 0
    t0 = time.perf_counter()
    bar = tqdm(total=n_windows, desc=desc, disable=not progress, leave=False, dynamic_ncols=True)
    with torch.no_grad():
        for x, y in D.sliding_windows(tokens, seq_len, stride, batch_size=batch_size):
            if device is not None:
                x, y = x.to(device), y.to(device)
            logits = logits_fn(x)
            if logits.shape[:2] != x.shape:
                raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for ids of shape {tuple(x.shape)}")
            keep = y != -100
            lg = logits[keep].float()
            tg = y[keep]
            nll += float(F.cross_entropy(lg, tg, reduction="sum"))
            top = lg.topk(min(10, lg.shape[-1]), dim=-1).indices
            correct1 += int((top[:, 0] == tg).sum())
            correct10 += int((top == tg[:, None]).any(-1).sum())
            count += int(tg.numel())
            bar.update(x.shape[0])
    bar.close()
    loss = nll / count
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "bits_per_token": loss / math.log(2),
        "top1": correct1 / count,
        "top10": correct10 / count,
        "tokens": count,
        "windows": n_windows,
        "seconds": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------------------------------
# Cost accounting: positional LSH vs windowed ALiBi at equal cost
# --------------------------------------------------------------------------------------------------


def window_cost(window: int, seq_len: int) -> int:
    """Causal score entries of windowed attention keeping ``|i - j| <= window``: ``sum_i min(i, window) + 1``."""
    w = min(max(int(window), 0), seq_len - 1)
    return (w + 1) * (w + 2) // 2 + (seq_len - w - 1) * (w + 1)


def expected_plsh_cost(
    slopes: torch.Tensor | Sequence[float],
    seq_len: int,
    *,
    scheme: str = "discrete",
    draws: int = 512,
    seed: int = 0,
) -> torch.Tensor:
    """Expected causal score entries of ONE positional-LSH sample, per head, at ``seq_len``: ``(H,)`` float64.

    A block of ``s`` positions costs ``s (s + 1) / 2`` causal entries; averaged over ``draws`` sampled
    partitions (Monte Carlo, seeded). A head with slope 0 is one block: ``n (n + 1) / 2``.
    """
    parts = sample_partitions(
        seq_len, torch.as_tensor(slopes, dtype=torch.float64), draws, scheme=scheme, generator=seed
    )
    out = torch.zeros(parts.num_heads, dtype=torch.float64)
    for h in range(parts.num_heads):
        total = 0.0
        for t in range(draws):
            for seg in parts.segments(t, h):
                total += seg.count * seg.k_len * (seg.k_len + 1) / 2
        out[h] = total / draws
    return out


def equal_cost_window(
    slopes: torch.Tensor | Sequence[float],
    num_samples: int,
    seq_len: int,
    *,
    scheme: str = "discrete",
    draws: int = 512,
    seed: int = 0,
) -> torch.Tensor:
    """Per-head window ``w_h`` (``(H,)`` float64) whose windowed-ALiBi causal cost equals ``T`` positional-LSH
    samples: the largest integer ``w`` with ``window_cost(w, n) <= T * expected_plsh_cost``, capped at ``n - 1``
    (where ``T`` samples cost as much as exact attention, the window is the whole sequence)."""
    cost = expected_plsh_cost(slopes, seq_len, scheme=scheme, draws=draws, seed=seed) * num_samples
    out = torch.empty_like(cost)
    for h, target in enumerate(cost.tolist()):
        lo, hi = 0, seq_len - 1
        while lo < hi:  # largest w with window_cost(w) <= target
            mid = (lo + hi + 1) // 2
            if window_cost(mid, seq_len) <= target:
                lo = mid
            else:
                hi = mid - 1
        out[h] = lo
    return out


def _mean_cost_per_query(per_head_cost: torch.Tensor, seq_len: int) -> float:
    return float(per_head_cost.mean()) / seq_len


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalRow:
    """One evaluation: a model, an attention variant, an evaluation length."""

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


class _Adapter:
    """A uniform interface over this library's models and transformers models: logits and attention swaps."""

    def __init__(self, model: Any, label: str, train_len: int, slopes: torch.Tensor | None, own: str) -> None:
        self.model = model
        self.label = label
        self.train_len = train_len
        self.slopes = slopes  # None: no ALiBi-family variants
        self.own = own  # description of the model's own attention

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def set_attention(self, kind: str, **kw: Any) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


class _OurAdapter(_Adapter):
    def __init__(self, model: TransformerLM, label: str) -> None:
        cfg = model.cfg
        alibi_family = cfg.position in ("alibi", "plsh", "window-alibi")
        super().__init__(model, label, cfg.seq_len, cfg.slopes() if alibi_family else None, cfg.describe())
        self._own_cfg = cfg
        self.sweepable = cfg.position in ("alibi", "plsh")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def set_attention(self, kind: str, **kw: Any) -> None:
        keep = {"sigma": self._own_cfg.sigma, "eval_seed": kw.get("eval_seed", self._own_cfg.eval_seed)}
        if kind == "alibi":
            self.model.set_position("alibi", **keep)
        elif kind == "plsh":
            self.model.set_position("plsh", num_samples=kw["samples"], scheme=kw["scheme"], **keep)
        elif kind == "window":
            self.model.set_position("window-alibi", window=[float(w) for w in kw["window"]], **keep)
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def reset(self) -> None:
        own = self._own_cfg
        self.model.set_position(
            own.position,
            **{f: getattr(own, f) for f in ("num_samples", "scheme", "sigma", "window", "window_factor", "eval_seed")},
        )


class _HFAdapter(_Adapter):
    def __init__(self, model: Any, label: str, train_len: int, seed: int) -> None:
        from positional_lsh.integrations import hf

        self.hf = hf
        self.seed = seed
        family = hf.model_family(model)
        slopes = None
        if family in hf.NATIVE_ALIBI_TYPES:
            swap = hf.use_alibi(model)
            slopes = swap.slopes.clone()
            hf.restore(model)
        super().__init__(model, label, train_len, slopes, f"native {model.config.model_type}")
        self.sweepable = slopes is not None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def set_attention(self, kind: str, **kw: Any) -> None:
        if kind == "alibi":
            self.hf.use_alibi(self.model)
        elif kind == "plsh":
            self.hf.use_positional_lsh(self.model, num_samples=kw["samples"], scheme=kw["scheme"], seed=self.seed)
        elif kind == "window":
            self.hf.use_alibi(self.model, window=kw["window"])
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def reset(self) -> None:
        self.hf.restore(self.model)


def _hf_train_len(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _encode_hf(tokenizer: Any, docs: Sequence[D.Document]) -> torch.Tensor:
    """A transformers tokenizer's token stream: each document's ids followed by its EOS id (if it has one)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d.text, add_special_tokens=False, verbose=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
    return torch.tensor(ids, dtype=torch.long)


def _load(
    path: str | os.PathLike[str] | None,
    *,
    label: str | None,
    data: str | None,
    split: str,
    train_len: int | None,
    tokenizer: str | None,
    cache_dir: Path | None,
    seed: int,
    device: torch.device,
) -> tuple[_Adapter, torch.Tensor]:
    """Load a model (ours or transformers') and the evaluation token stream encoded with its tokenizer."""
    p = shipped_checkpoint_path() if path is None else Path(path)
    name = label or (p.name if path is not None else "shipped alibi-lm")
    if path is None and not is_checkpoint(p):
        raise FileNotFoundError(f"the shipped model is missing from {p}; name a checkpoint directory")
    if is_checkpoint(p):
        ckpt = load_checkpoint(p, device=device, eval_seed=seed)
        tok = D.BPETokenizer.load(tokenizer) if tokenizer else ckpt.tokenizer
        if tok is None:
            raise ValueError(f"checkpoint {p} has no tokenizer.json; pass --tokenizer")
        source = data if data is not None else ckpt.metadata.get("train_config", {}).get("data")
        splits = D.load_splits(source)
        if split not in splits:
            raise ValueError(f"split must be one of {sorted(splits)}, got {split!r}")
        stream = D.encode_splits(tok, {split: splits[split]}, cache_dir=cache_dir)[split]
        adapter: _Adapter = _OurAdapter(ckpt.model, name)
        if train_len is not None:
            adapter.train_len = train_len
        return adapter, stream
    if p.is_dir() and (p / "config.json").is_file():
        from positional_lsh.integrations import hf

        loaded = hf.load_local_model(p, device=device)
        tl = train_len or _hf_train_len(loaded.model.config)
        if tl is None:
            raise ValueError(f"cannot tell the training length of {p} from its config; pass --train-len")
        splits = D.load_splits(data)
        if split not in splits:
            raise ValueError(f"split must be one of {sorted(splits)}, got {split!r}")
        if tokenizer:
            stream = D.encode_documents(D.BPETokenizer.load(tokenizer), splits[split])
        elif loaded.tokenizer is not None:
            stream = _encode_hf(loaded.tokenizer, splits[split])
        else:
            raise ValueError(f"{p} has no tokenizer files; pass --tokenizer")
        return _HFAdapter(loaded.model, name, tl, seed), stream
    raise ValueError(
        f"checkpoint {p} is neither a positional-lsh checkpoint (config.json + model.safetensors written by "
        "plsh train) nor a transformers save_pretrained folder"
    )


def _lengths(train_len: int, factors: Sequence[float]) -> list[tuple[float, int]]:
    return [(f, max(1, round(train_len * f))) for f in factors]


def evaluate_model(
    adapter: _Adapter,
    tokens: torch.Tensor,
    *,
    factors: Sequence[float] = DEFAULT_FACTORS,
    stride: int | str | None = None,
    max_tokens: int | None = None,
    samples: Sequence[int] = DEFAULT_SAMPLES,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    sweep_factors: Sequence[float] | None = None,
    equal_cost: bool = True,
    batch_tokens: int = 8192,
    progress: bool = True,
    on_row: Callable[[EvalRow], None] | None = None,
) -> list[EvalRow]:
    """Evaluate one loaded model at every length in ``factors`` (and the sweep at ``sweep_factors``).

    ``tokens`` is the evaluation stream; ``max_tokens`` keeps its first ``max_tokens + 1`` tokens (the same
    scored tokens at every length). ``stride``: tokens between window starts, default the training length;
    ``"window"`` for disjoint windows (stride = evaluation length, the cheapest). ``samples=()`` skips the sweep.
    """
    stream = tokens if max_tokens is None else tokens[: max_tokens + 1]
    tl = adapter.train_len
    if stride is not None and stride != "window" and (isinstance(stride, bool) or not isinstance(stride, int)):
        raise TypeError(f"stride must be an int, 'window' or None, got {stride!r}")

    def stride_for(length: int) -> int:
        if stride == "window":
            return length
        return min(tl if stride is None else int(stride), length)

    rows: list[EvalRow] = []
    sweep_f = list(factors if sweep_factors is None else sweep_factors)

    def run(kind: str, label: str, factor: float, length: int, **kw: Any) -> None:
        if stream.numel() < length + 1:
            print(f"plsh eval: skipping length {length}: the stream has only {stream.numel()} tokens", file=sys.stderr)
            return
        if kind != "own":
            adapter.set_attention(kind, **kw)
        try:
            m = sliding_window_metrics(
                adapter.logits,
                stream,
                length,
                stride_for(length),
                batch_size=max(1, batch_tokens // length),
                device=adapter.device,
                progress=progress,
                desc=f"{adapter.label} {label} L={length}",
            )
        finally:
            adapter.reset()
        row = EvalRow(
            model=adapter.label,
            attention=label,
            kind=kind,
            train_len=tl,
            eval_len=length,
            factor=factor,
            stride=stride_for(length),
            samples=kw.get("samples"),
            scheme=kw.get("scheme"),
            loss=m["loss"],
            ppl=m["ppl"],
            bits_per_token=m["bits_per_token"],
            top1=m["top1"],
            top10=m["top10"],
            tokens=m["tokens"],
            seconds=m["seconds"],
            cost_per_query=kw.get("cost"),
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)

    one_sample: dict[tuple[int, str], torch.Tensor] = {}

    def plsh_cost(length: int, t: int, scheme: str) -> float:
        assert adapter.slopes is not None
        if (length, scheme) not in one_sample:
            one_sample[(length, scheme)] = expected_plsh_cost(adapter.slopes, length, scheme=scheme)
        # identical samples (the deterministic "fixed" scheme) are computed once by plsh_attention
        return _mean_cost_per_query(one_sample[(length, scheme)] * (1 if scheme == "fixed" else t), length)

    def windowed_cost(window: torch.Tensor, length: int) -> float:
        return _mean_cost_per_query(torch.tensor([float(window_cost(int(w), length)) for w in window]), length)

    own_cfg = getattr(adapter.model, "cfg", None)
    for factor, length in _lengths(tl, factors):
        cost = (length + 1) / 2  # exact causal attention, rope, nope, native transformers attention
        if own_cfg is not None and own_cfg.position == "plsh":
            cost = plsh_cost(length, own_cfg.num_samples, own_cfg.scheme)
        elif own_cfg is not None and own_cfg.position == "window-alibi":
            cost = windowed_cost(own_cfg.windows().clamp(max=length), length)
        run("own", f"own: {adapter.own}", factor, length, cost=cost)
    if adapter.slopes is None or not getattr(adapter, "sweepable", False):
        return rows
    slopes = adapter.slopes
    if not adapter.own.startswith("alibi"):
        for factor, length in _lengths(tl, factors):
            run("alibi", "exact ALiBi", factor, length, cost=(length + 1) / 2)
    for factor, length in _lengths(tl, sweep_f):
        for t in samples:
            for scheme in schemes:
                cost = plsh_cost(length, t, scheme)
                run("plsh", f"plsh T={t} {scheme}", factor, length, samples=t, scheme=scheme, cost=cost)
            if equal_cost:
                window = equal_cost_window(slopes, t, length)
                cost = windowed_cost(window, length)
                run("window", f"window-alibi = cost of T={t}", factor, length, samples=t, window=window, cost=cost)
    return rows


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------

_COLUMNS = [f.name for f in dataclasses.fields(EvalRow)]


def format_table(rows: Sequence[EvalRow]) -> str:
    """A Markdown table of the rows."""
    head = ["model", "attention", "L", "L/train", "loss", "ppl", "bits/tok", "top-1", "top-10", "cost/query", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        cost = "" if r.cost_per_query is None else f"{r.cost_per_query:.1f}"
        cells = [r.model, r.attention, str(r.eval_len), f"{r.factor:g}x", f"{r.loss:.4f}", f"{r.ppl:.2f}",
                 f"{r.bits_per_token:.3f}", f"{r.top1:.4f}", f"{r.top10:.4f}", cost, f"{r.seconds:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(rows: Sequence[EvalRow], out_dir: str | os.PathLike[str], *, plots: bool = True) -> list[Path]:
    """Write ``results.csv``, ``results.md`` and (with matplotlib) ``extrapolation.png`` and ``sweep.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))
    written.append(out / "results.csv")
    (out / "results.md").write_text(format_table(rows) + "\n", encoding="utf-8")
    written.append(out / "results.md")
    if plots:
        written += plot_results(rows, out)
    return written


def read_results(path: str | os.PathLike[str]) -> list[EvalRow]:
    """Read rows back from a ``results.csv``."""
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
    return rows


def plot_results(rows: Sequence[EvalRow], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``extrapolation.png`` (perplexity vs L / training length, one line per model and attention, without the
    sweep) and ``sweep.png`` (perplexity vs T per evaluation length: schemes, equal-cost windowed ALiBi and exact
    ALiBi). Needs matplotlib; returns ``[]`` with a warning when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plsh eval: matplotlib is not installed; no plots written (pip install matplotlib)", file=sys.stderr)
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: dict[tuple[str, str], list[EvalRow]] = {}
    for r in rows:
        if r.kind in ("own", "alibi"):
            curves.setdefault((r.model, r.attention), []).append(r)
    for (model, att), rs in curves.items():
        rs = sorted(rs, key=lambda r: r.factor)
        ax.plot([r.factor for r in rs], [r.ppl for r in rs], marker="o", label=f"{model} — {att}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length / training length")
    ax.set_ylabel("perplexity (sliding window)")
    ax.set_title("Length extrapolation")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "extrapolation.png", dpi=110)
    plt.close(fig)
    written.append(out / "extrapolation.png")

    sweep = [r for r in rows if r.kind in ("plsh", "window")]
    if sweep:
        models = list(dict.fromkeys(r.model for r in sweep))
        lengths = sorted({r.eval_len for r in sweep})
        fig, axes = plt.subplots(
            len(models), len(lengths), figsize=(3.6 * len(lengths), 3.2 * len(models)), squeeze=False
        )
        for i, model in enumerate(models):
            for j, length in enumerate(lengths):
                ax = axes[i][j]
                sub = [r for r in sweep if r.model == model and r.eval_len == length]
                for scheme in dict.fromkeys(r.scheme for r in sub if r.kind == "plsh"):
                    pts = sorted((r for r in sub if r.kind == "plsh" and r.scheme == scheme), key=lambda r: r.samples)
                    ax.plot([r.samples for r in pts], [r.ppl for r in pts], marker="o", label=f"plsh {scheme}")
                pts = sorted((r for r in sub if r.kind == "window"), key=lambda r: r.samples)
                if pts:
                    ax.plot(
                        [r.samples for r in pts], [r.ppl for r in pts], marker="s", label="windowed ALiBi, equal cost"
                    )
                exact = [
                    r
                    for r in rows
                    if r.model == model
                    and r.eval_len == length
                    and (r.kind == "alibi" or (r.kind == "own" and r.attention.startswith("own: alibi")))
                ]
                if exact:
                    ax.axhline(exact[0].ppl, color="k", ls="--", lw=1, label="exact ALiBi")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{model}, L={length}", fontsize=9)
                ax.set_xlabel("T (windows: equal cost)")
                ax.set_ylabel("perplexity")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=110)
        plt.close(fig)
        written.append(out / "sweep.png")
    return written


# --------------------------------------------------------------------------------------------------
# The shipped model in `plsh demo`
# --------------------------------------------------------------------------------------------------


@dataclass
class ShippedDemo:
    """What :func:`shipped_model_demo` computed."""

    rows: list[dict[str, Any]]
    prompt: str
    continuation: str
    seconds: float
    description: str

    def __str__(self) -> str:
        lines = [self.description, ""]
        head = f"{'attention':34s} {'ppl':>8s} {'rel. to exact':>14s}"
        lines += [head, "-" * len(head)]
        exact = self.rows[0]["ppl"]
        for r in self.rows:
            lines.append(f"{r['attention']:34s} {r['ppl']:8.2f} {r['ppl'] / exact - 1:+14.1%}")
        lines += [
            "",
            f"prompt: {self.prompt!r}",
            f"continuation: {self.continuation!r} (exact ALiBi; sampled: temperature 0.8, top-k 40, seed 0)",
        ]
        return "\n".join(lines)


def shipped_model_demo(
    progress: bool = True,
    *,
    samples: Sequence[int] = (1, 4, 16),
    num_tokens: int = 2048,
    factor: int = 2,
    new_tokens: int = 40,
    threads: int | None = None,
) -> ShippedDemo:
    """Perplexity of the shipped ALiBi model with exact ALiBi vs positional LSH, and a generated continuation.

    The text is the start of *Persuasion* (a held-out test document): ``num_tokens`` tokens scored with
    disjoint windows of ``factor`` times the training length (beyond the training length, where ALiBi
    extrapolates), with exact ALiBi and with positional-LSH attention (``discrete`` scheme, seeded eval
    partitions) at each ``T`` in ``samples``. Then ``new_tokens`` tokens are sampled (top-k 40, seed 0) after
    a prompt from the same book. Takes a few seconds on 2 CPU cores.
    """
    t0 = time.perf_counter()
    if threads is not None:
        torch.set_num_threads(threads)
    ckpt = load_checkpoint(shipped_checkpoint_path())
    model, tok = ckpt.model, ckpt.tokenizer
    assert tok is not None
    persuasion = next(d for d in D.corpus_splits()["test"] if d.id == "austen/persuasion")
    text = persuasion.text[: num_tokens * 6]
    ids = torch.tensor(tok.encode(text)[: num_tokens + 1], dtype=torch.long)
    length = model.cfg.seq_len * factor
    rows = []
    variants: list[tuple[str, dict[str, Any]]] = [("exact ALiBi", {"position": "alibi"})]
    variants += [(f"positional LSH, T={t}", {"position": "plsh", "num_samples": t}) for t in samples]
    for name, settings in tqdm(variants, desc="shipped model", disable=not progress, leave=False):
        model.set_position(**settings)
        m = sliding_window_metrics(model, ids, length, batch_size=max(1, 8192 // length))
        rows.append({"attention": name, "ppl": m["ppl"], "loss": m["loss"], "tokens": m["tokens"]})
    model.set_position("alibi")
    cut = persuasion.text.find("Sir Walter Elliot")
    prompt = persuasion.text[cut : cut + 200].rsplit(" ", 1)[0] if cut >= 0 else persuasion.text[:200]
    prompt_ids = torch.tensor([tok.encode(prompt)], dtype=torch.long)
    out = model.generate(prompt_ids, new_tokens, temperature=0.8, top_k=40, generator=0)
    continuation = tok.decode(out[0, prompt_ids.shape[1] :])
    desc = (
        f"Shipped model ({ckpt.metadata.get('num_params', 0) / 1e6:.1f} M parameters, trained with exact ALiBi at "
        f"{model.cfg.seq_len} tokens): perplexity on {rows[0]['tokens']} tokens of Persuasion (held out), "
        f"windows of {length} tokens ({factor}x the training length)"
    )
    return ShippedDemo(rows, prompt, continuation, time.perf_counter() - t0, desc)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return out


def _ints(text: str) -> list[int]:
    if text.strip() in ("", "none"):
        return []
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _stride(text: str) -> int | str:
    if text == "window":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'window', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'window', got {text!r}")
    return value


def _schemes(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [s for s in out if s not in SCHEMES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"schemes must be among {SCHEMES}, got {text!r}")
    return out


def run_eval(args: argparse.Namespace) -> list[EvalRow]:
    """Evaluate every checkpoint named on the command line; write and print the results."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cache = None if args.cache_dir == "" else Path(args.cache_dir) if args.cache_dir else _default_cache()
    paths: list[str | None] = list(args.checkpoints) or [None]
    labels = args.labels.split(",") if args.labels else [None] * len(paths)
    if len(labels) != len(paths):
        raise ValueError(f"--labels has {len(labels)} names for {len(paths)} checkpoints")
    rows: list[EvalRow] = []
    out = Path(args.out) if args.out else None

    def on_row(r: EvalRow) -> None:
        rows.append(r)
        print(
            f"{r.model} | {r.attention} | L={r.eval_len} ({r.factor:g}x) | loss {r.loss:.4f} ppl {r.ppl:.2f} "
            f"top1 {r.top1:.3f} top10 {r.top10:.3f} | {r.seconds:.0f} s",
            flush=True,
        )
        if out is not None:  # keep partial results of long evaluations
            write_results(rows, out, plots=False)

    for path, label in zip(paths, labels, strict=True):
        adapter, stream = _load(
            path,
            label=label,
            data=args.data,
            split=args.split,
            train_len=args.train_len,
            tokenizer=args.tokenizer,
            cache_dir=cache,
            seed=args.eval_seed,
            device=device,
        )
        evaluate_model(
            adapter,
            stream,
            factors=args.factors,
            stride=args.stride,
            max_tokens=args.max_tokens,
            samples=args.samples,
            schemes=args.schemes,
            sweep_factors=args.sweep_factors,
            equal_cost=not args.no_equal_cost,
            batch_tokens=args.batch_tokens,
            progress=not args.no_progress,
            on_row=on_row,
        )
    print()
    print(format_table(rows))
    if out is not None:
        for p in write_results(rows, out):
            print(f"wrote {p}")
    return rows


def _default_cache() -> Path:
    from positional_lsh.lm.train import default_cache_dir

    return default_cache_dir()


def _main(args: argparse.Namespace) -> int:
    try:
        run_eval(args)
    except (TypeError, ValueError, FileNotFoundError) as exc:
        print(f"plsh eval: error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoints",
        nargs="*",
        help="checkpoint directories (plsh train output or a local transformers folder); default: the shipped model",
    )
    p.add_argument("--labels", help="comma-separated names for the checkpoints in tables and plots")
    p.add_argument("--out", help="directory for results.csv, results.md and the PNG plots")
    p.add_argument("--data", help="evaluation corpus (load_splits source); default: the checkpoint's training corpus")
    p.add_argument("--split", default="test", help="split to evaluate (test)")
    p.add_argument("--factors", type=_floats, default=list(DEFAULT_FACTORS), help="lengths / train length (1,2,4,8,16)")
    p.add_argument(
        "--stride", type=_stride, help="window stride in tokens, or 'window' for disjoint windows (training length)"
    )
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens of the split (default: all)")
    p.add_argument("--samples", type=_ints, default=list(DEFAULT_SAMPLES), help="sweep T values (1,4,16,64; none)")
    p.add_argument("--schemes", type=_schemes, default=list(DEFAULT_SCHEMES), help="sweep schemes")
    p.add_argument("--sweep-factors", type=_floats, help="lengths of the sweep (default: --factors)")
    p.add_argument("--no-equal-cost", action="store_true", help="skip windowed ALiBi at equal cost")
    p.add_argument("--eval-seed", type=int, default=0, help="seed of the evaluation partitions (0)")
    p.add_argument("--train-len", type=int, help="training length (transformers models without one in the config)")
    p.add_argument("--tokenizer", help="tokenizer.json to encode the data with (instead of the checkpoint's)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per forward pass (8192)")
    p.add_argument("--cache-dir", help="token cache directory ('' disables)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda ...")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true")


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="sliding-window perplexity at 1x-16x the training length; positional-LSH sweep vs windowed ALiBi",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_eval_arguments(p)
    p.set_defaults(func=_main)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plsh eval")
    add_eval_arguments(parser)
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
