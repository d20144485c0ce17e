"""Windows of a token stream: ``(inputs, targets)`` pairs for training and evaluation.

``random_batch`` and ``random_windows`` give seeded random windows for training; ``sliding_windows`` gives
strided windows for evaluation in which every token is scored exactly once. Every window pair has shape
``(batch, seq_len)`` with ``targets`` the inputs shifted by one token.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator

import torch

from positional_lsh.ops.checks import as_generator, positive_int


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
