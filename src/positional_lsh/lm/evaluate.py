"""Sliding-window perplexity at and beyond the training length, and the positional-LSH sweep (``plsh eval``).

Protocol (the ALiBi paper's sliding-window evaluation, as the positional-LSH paper ran it): the evaluation split
is one token stream (documents joined by the end-of-document token); windows of ``L`` tokens start every
``stride`` tokens (default: the training length), and each window scores only the tokens no earlier window
scored, so every token after the first is scored exactly once, with at least ``L - stride`` tokens of context
(:func:`positional_lsh.lm.data.sliding_windows`). ``L`` runs over multiples of the training length (1x, 2x, 4x,
8x, 16x). Metrics over the scored tokens: mean cross-entropy (nats), perplexity, bits per token, top-1 and
top-10 accuracy, mean reciprocal rank of the target (:func:`reciprocal_ranks`), mean predictive entropy (nats,
:func:`predictive_entropy`), and the mean loss by position within the window that scored the token
(:func:`position_buckets`: does the model use the extra context?).

Attention variants evaluated for each model:

* the model's own attention (``own``) at every length;
* for ALiBi- and positional-LSH-trained models: exact ALiBi (for a positional-LSH model this is the
  ``T -> infinity`` limit of its own attention) at every length, then the **sweep**: positional-LSH attention
  with ``T`` samples (1, 4, 16, 64) for each scheme (``discrete``, ``gamma``, ``fixed``), and windowed ALiBi
  at **equal cost** for each ``T``: per head, the window whose causal score-entry count equals the expected
  count of ``T`` positional-LSH samples of the ``discrete`` scheme at that length (:func:`equal_cost_window`).

Models: this library's checkpoints (:func:`positional_lsh.lm.checkpoint.load_checkpoint`) and local transformers
checkpoints (a ``save_pretrained`` folder, via :func:`positional_lsh.integrations.hf.load_local_model`): their own
attention, and for native ALiBi models (BLOOM, MPT, Falcon with ``alibi=True``) the library's exact ALiBi,
the positional-LSH sweep and windowed ALiBi through the ``positional_lsh.integrations.hf`` swaps.

Models are loaded by :func:`positional_lsh.lm.eval_models.load_for_eval` and evaluated by :func:`evaluate_model`;
the rows (:class:`~positional_lsh.lm.eval_results.EvalRow`) are written by
:func:`positional_lsh.lm.eval_results.write_results` (``results.csv``, ``loss_by_position.csv``, ``results.md``
and PNG plots: perplexity vs evaluation length, perplexity vs ``T``, loss vs position within the window). The
command line is :mod:`positional_lsh.cli.eval`.

A model trained with learned slopes (``ModelConfig.learn_slopes``) keeps them in every variant: exact ALiBi, the
sweep's positional LSH (partitions drawn from each layer's learned slopes) and its windowed ALiBi at equal cost
(one window per layer and head, from that layer's slopes); the cost columns average over every layer's heads.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from tqdm.auto import tqdm

from positional_lsh.lm import data as D
from positional_lsh.lm.checkpoint import load_checkpoint, shipped_checkpoint_path
from positional_lsh.lm.eval_models import HFAdapter, ModelAdapter, load_for_eval
from positional_lsh.lm.eval_results import (
    EvalRow,
    PositionBucket,
    plot_results,
    read_results,
)
from positional_lsh.ops import sample_partitions
from positional_lsh.ops.errors import UserError

__all__ = ["EvalRow", "evaluate_model", "load_for_eval", "plot_results", "read_results"]

DEFAULT_FACTORS = (1, 2, 4, 8, 16)
DEFAULT_SAMPLES = (1, 4, 16, 64)
DEFAULT_SCHEMES = ("discrete", "gamma", "fixed")
DEFAULT_POSITION_BUCKETS = 16

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def reciprocal_ranks(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``1 / rank`` of each target token: ``logits`` ``(N, V)``, ``targets`` ``(N,)`` -> ``(N,)`` float32.

    ``rank = 1 +`` the number of vocabulary entries whose logit is *strictly* greater than the target's: ties
    count in the target's favour (a target tied with others for the largest logit has rank 1). Comparisons are
    made on the logits (softmax is monotone); the mean is the mean reciprocal rank (MRR).
    """
    lg = logits.float()
    target = lg.gather(-1, targets[:, None].long())
    rank = 1 + (lg > target).sum(-1)
    return 1.0 / rank.float()


def predictive_entropy(logits: torch.Tensor, log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy in nats of ``softmax(logits)`` along the last axis (float32), ``H = -sum_v p_v log p_v``.

    Computed from ``log_softmax`` (pass it as ``log_probs`` when already at hand); entries whose probability is
    0 (a ``-inf`` logit, or one so far below the largest that ``exp`` underflows) contribute 0, never NaN.
    """
    logp = torch.log_softmax(logits.float(), dim=-1) if log_probs is None else log_probs
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(-1)


def position_buckets(
    nll_sums: Sequence[float] | torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    num_buckets: int = DEFAULT_POSITION_BUCKETS,
) -> list[PositionBucket]:
    """Mean loss per bucket of position within the window, from per-position summed losses and token counts.

    ``nll_sums[i]`` / ``counts[i]``: summed loss / number of scored tokens at position ``i`` of their window
    (``i = 0 .. L - 1``, as :func:`sliding_window_metrics` returns them). Buckets split ``[0, L)`` into
    ``min(num_buckets, L)`` near-equal half-open ranges ``[k L // B, (k + 1) L // B)`` (one per position when
    ``L <= num_buckets``); buckets without scored tokens are left out, so the counts sum to the scored tokens and
    their count-weighted mean loss is the overall mean loss.
    """
    sums = torch.as_tensor(nll_sums, dtype=torch.float64).flatten()
    cnt = torch.as_tensor(counts, dtype=torch.int64).flatten()
    if sums.shape != cnt.shape:
        raise ValueError(f"nll_sums and counts must have the same length, got {sums.numel()} and {cnt.numel()}")
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets must be a positive int, got {num_buckets!r}")
    length = sums.numel()
    b = min(num_buckets, length)
    edges = [k * length // b for k in range(b + 1)]
    out = []
    for lo, hi in pairwise(edges):
        n = int(cnt[lo:hi].sum())
        if n > 0:
            out.append(PositionBucket(lo, hi, float(sums[lo:hi].sum()) / n, n))
    return out


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
) -> dict[str, Any]:
    """Sliding-window metrics of a causal LM on one token stream.

    Args:
        logits_fn: maps ``(b, seq_len)`` int64 ids to ``(b, seq_len, V)`` next-token logits.
        tokens: 1-D integer token stream of at least ``seq_len + 1`` tokens.
        seq_len: window length ``L``.
        stride: window step (default ``L``: disjoint windows); each window scores only its new tokens.
        batch_size: windows per call of ``logits_fn``.
        device: where to put the ids (default: CPU).

    Returns:
        ``{"loss", "ppl", "bits_per_token", "top1", "top10", "mrr", "entropy", "tokens", "windows", "seconds",
        "position_nll", "position_count"}``: mean cross-entropy in nats over the scored tokens, ``exp(loss)``,
        ``loss / ln 2``, top-1 / top-10 accuracy, mean reciprocal rank of the target (:func:`reciprocal_ranks`:
        ties count in the target's favour), mean entropy of the predicted distribution in nats
        (:func:`predictive_entropy`), the number of scored tokens (``len(tokens) - 1``) and of windows, and per
        position ``i = 0 .. seq_len - 1`` within the window that scored them, the summed loss (list of floats) and
        number (list of ints) of the scored tokens (:func:`position_buckets` makes the curve). A later window
        scores only its last ``stride`` positions, so positions ``< seq_len - stride`` count only tokens of the
        first window.

    Everything is accumulated per batch of windows: at most one batch of logits is held at a time.
    """
    if not callable(logits_fn):
        raise TypeError(f"logits_fn must be callable, got {type(logits_fn).__name__}")
    n_windows = D.num_sliding_windows(int(tokens.numel()) if isinstance(tokens, torch.Tensor) else 0, seq_len, stride)
    totals = [0.0, 0, 0, 0, 0.0, 0.0]  # summed nll, top-1 hits, top-10 hits, scored tokens, summed 1/rank, entropy
    pos_nll = torch.zeros(seq_len, dtype=torch.float64)
    pos_count = torch.zeros(seq_len, dtype=torch.int64)
    t0 = time.perf_counter()
    bar = tqdm(total=n_windows, desc=desc, disable=not progress, leave=False, dynamic_ncols=True)
    with torch.no_grad():
        for x, y in D.sliding_windows(tokens, seq_len, stride, batch_size=batch_size):
            if device is not None:
                x, y = x.to(device), y.to(device)
            logits = logits_fn(x)
            if logits.shape[:2] != x.shape:
                raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for ids of shape {tuple(x.shape)}")
            sums, p_nll, p_count = _window_sums(logits, y)
            totals = [a + b for a, b in zip(totals, sums, strict=True)]
            pos_nll += p_nll
            pos_count += p_count
            bar.update(x.shape[0])
    bar.close()
    nll, correct1, correct10, count, rr, entropy = totals
    loss = nll / count
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "bits_per_token": loss / math.log(2),
        "top1": correct1 / count,
        "top10": correct10 / count,
        "mrr": rr / count,
        "entropy": entropy / count,
        "tokens": count,
        "windows": n_windows,
        "seconds": time.perf_counter() - t0,
        "position_nll": pos_nll.tolist(),
        "position_count": pos_count.tolist(),
    }


def _window_sums(
    logits: torch.Tensor, y: torch.Tensor
) -> tuple[tuple[float, int, int, int, float, float], torch.Tensor, torch.Tensor]:
    """Of one batch of windows: (summed cross-entropy, top-1 hits, top-10 hits, number of scored targets
    (``y != -100``), summed reciprocal rank, summed entropy), and the summed cross-entropy and target count per
    position within the window (``(L,)`` float64 and int64, on the CPU)."""
    keep = y != -100
    lg = logits[keep].float()
    tg = y[keep]
    top = lg.topk(min(10, lg.shape[-1]), dim=-1).indices
    hits1, hits10 = int((top[:, 0] == tg).sum()), int((top == tg[:, None]).any(-1).sum())
    logp = torch.log_softmax(lg, dim=-1)
    # per-token values (N,) go to the CPU and are summed in float64 there (float64 is not on every device)
    nll = -logp.gather(-1, tg[:, None]).squeeze(-1).cpu().double()
    ent = predictive_entropy(lg, logp).cpu().double()
    del logp
    rr = reciprocal_ranks(lg, tg).cpu().double()
    length = y.shape[1]
    pos = torch.arange(length).expand(y.shape)[keep.cpu()]
    p_nll = torch.zeros(length, dtype=torch.float64).index_add_(0, pos, nll)
    p_count = torch.bincount(pos, minlength=length)
    return (float(nll.sum()), hits1, hits10, int(tg.numel()), float(rr.sum()), float(ent.sum())), p_nll, p_count


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
            sizes = parts.blocks(t, h)[1].to(torch.float64)
            total += float((sizes * (sizes + 1) / 2).sum())
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
# Evaluation of one model
# --------------------------------------------------------------------------------------------------


def _lengths(train_len: int, factors: Sequence[float]) -> list[tuple[float, int]]:
    return [(f, max(1, round(train_len * f))) for f in factors]


def check_something_to_score(
    train_len: int, factors: Sequence[float], num_tokens: int, max_tokens: int | None = None, *, what: str = "stream"
) -> None:
    """Raise :class:`~positional_lsh.ops.errors.UserError` (saying why) when no length of ``factors`` fits the
    ``num_tokens`` evaluation tokens (cut to ``max_tokens + 1``): the evaluation would score nothing."""
    n = num_tokens if max_tokens is None else min(num_tokens, max_tokens + 1)
    lengths = [length for _, length in _lengths(train_len, factors)]
    if lengths and min(lengths) + 1 > n:
        cut = f" (--max-tokens {max_tokens})" if max_tokens is not None and max_tokens + 1 < num_tokens else ""
        raise UserError(
            f"nothing to score: the {what} has {n} tokens{cut} but the shortest evaluation length is {min(lengths)} "
            f"(training length {train_len} x --factors {min(factors):g}) and needs {min(lengths) + 1}; "
            "raise --max-tokens or lower --factors"
        )


def evaluate_model(
    adapter: ModelAdapter,
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

    ``adapter`` comes from :func:`~positional_lsh.lm.eval_models.load_for_eval` (or wraps a model itself, see
    :class:`~positional_lsh.lm.eval_models.ModelAdapter`); ``tokens`` is the evaluation stream; ``max_tokens``
    keeps its first ``max_tokens + 1`` tokens (the same scored tokens at every length). ``stride``: tokens
    between window starts, default the training length; ``"window"`` for disjoint windows (stride = evaluation
    length, the cheapest). ``samples=()`` skips the sweep. ``on_row`` is called with each row as it is measured.
    """
    if stride is not None and stride != "window" and (isinstance(stride, bool) or not isinstance(stride, int)):
        raise TypeError(f"stride must be an int, 'window' or None, got {stride!r}")
    ev = _Evaluation(adapter, tokens if max_tokens is None else tokens[: max_tokens + 1], stride, batch_tokens,
                     progress, on_row)  # fmt: skip
    tl = adapter.train_len
    own_cfg = getattr(adapter.model, "cfg", None)
    own_swap = adapter.hf.current_swap(adapter.model) if isinstance(adapter, HFAdapter) else None
    for factor, length in _lengths(tl, factors):
        cost = (length + 1) / 2  # exact causal attention, rope, nope, native transformers attention
        # The own row's cost follows the sweep rows' cost model (expected score entries of T samples, or of the
        # window), whether the attention is this library's model's or a swap installed on a transformers model.
        if own_cfg is not None and own_cfg.position == "plsh":
            cost = ev.plsh_cost(length, own_cfg.num_samples, own_cfg.scheme)
        elif own_cfg is not None and own_cfg.position == "window-alibi":
            windows = own_cfg.windows()
            if getattr(own_cfg, "learn_slopes", False):  # every layer's window follows its learned slopes
                windows = adapter.model.windows().reshape(-1)
            cost = ev.windowed_cost(windows.clamp(max=length), length)
        elif own_swap is not None and own_swap.num_samples is not None and own_swap.scheme is not None:
            cost = ev.plsh_cost(length, own_swap.num_samples, own_swap.scheme)  # the "plsh" mode
        elif own_swap is not None and own_swap.window is not None:
            cost = ev.windowed_cost(own_swap.window.clamp(max=length), length)
        ev.run("own", f"own: {adapter.own}", factor, length, cost=cost)
    if adapter.slopes is None or not adapter.sweepable:
        return ev.rows
    if not adapter.own.startswith("alibi"):
        for factor, length in _lengths(tl, factors):
            ev.run("alibi", "exact ALiBi", factor, length, cost=(length + 1) / 2)
    for factor, length in _lengths(tl, factors if sweep_factors is None else sweep_factors):
        for t in samples:
            for scheme in schemes:
                cost = ev.plsh_cost(length, t, scheme)
                ev.run("plsh", f"plsh T={t} {scheme}", factor, length, samples=t, scheme=scheme, cost=cost)
            if equal_cost:
                window = equal_cost_window(adapter.slopes, t, length)
                cost = ev.windowed_cost(window, length)
                ev.run("window", f"window-alibi = cost of T={t}", factor, length, samples=t, window=window, cost=cost)
    return ev.rows


class _Evaluation:
    """The measurements of :func:`evaluate_model`: one row per (attention variant, length)."""

    def __init__(
        self,
        adapter: ModelAdapter,
        stream: torch.Tensor,
        stride: int | str | None,
        batch_tokens: int,
        progress: bool,
        on_row: Callable[[EvalRow], None] | None,
    ) -> None:
        self.adapter, self.stream, self.stride = adapter, stream, stride
        self.batch_tokens, self.progress, self.on_row = batch_tokens, progress, on_row
        self.rows: list[EvalRow] = []
        self._one_sample: dict[tuple[int, str], torch.Tensor] = {}

    def stride_for(self, length: int) -> int:
        if self.stride == "window":
            return length
        return min(self.adapter.train_len if self.stride is None else int(self.stride), length)

    def plsh_cost(self, length: int, t: int, scheme: str) -> float:
        """Causal score entries per query per head of ``t`` positional-LSH samples (mean over heads)."""
        assert self.adapter.slopes is not None
        if (length, scheme) not in self._one_sample:
            self._one_sample[(length, scheme)] = expected_plsh_cost(self.adapter.slopes, length, scheme=scheme)
        # identical samples (the deterministic "fixed" scheme) are computed once by plsh_attention
        return _mean_cost_per_query(self._one_sample[(length, scheme)] * (1 if scheme == "fixed" else t), length)

    @staticmethod
    def windowed_cost(window: torch.Tensor, length: int) -> float:
        """Causal score entries per query per head of windowed attention (mean over heads)."""
        return _mean_cost_per_query(torch.tensor([float(window_cost(int(w), length)) for w in window]), length)

    def run(self, kind: str, label: str, factor: float, length: int, **kw: Any) -> None:
        """Measure one variant at one length (``kind != "own"``: swapped in, then the model's own restored)."""
        a = self.adapter
        if self.stream.numel() < length + 1:
            print(f"plsh eval: skipping length {length}: the stream has only {self.stream.numel()} tokens",
                  file=sys.stderr)  # fmt: skip
            return
        if kind != "own":
            a.set_attention(kind, **kw)
        try:
            m = sliding_window_metrics(
                a.logits, self.stream, length, self.stride_for(length), batch_size=max(1, self.batch_tokens // length),
                device=a.device, progress=self.progress, desc=f"{a.label} {label} L={length}",
            )  # fmt: skip
        finally:
            a.reset()
        row = EvalRow(
            model=a.label, attention=label, kind=kind, train_len=a.train_len, eval_len=length, factor=factor,
            stride=self.stride_for(length), samples=kw.get("samples"), scheme=kw.get("scheme"), loss=m["loss"],
            ppl=m["ppl"], bits_per_token=m["bits_per_token"], top1=m["top1"], top10=m["top10"], tokens=m["tokens"],
            seconds=m["seconds"], cost_per_query=kw.get("cost"), mrr=m["mrr"], entropy=m["entropy"],
            loss_by_position=position_buckets(m["position_nll"], m["position_count"]),
        )  # fmt: skip
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)


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
        for i, r in enumerate(self.rows):
            rel = "reference" if i == 0 else f"{r['ppl'] / exact - 1:+.1%}"  # the first row is exact ALiBi itself
            lines.append(f"{r['attention']:34s} {r['ppl']:8.2f} {rel:>14s}")
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
