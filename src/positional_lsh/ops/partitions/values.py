"""The checks of a :class:`~positional_lsh.ops.partitions.partition.Partitions`' values, run once when one is made:
:func:`check_partition_values` (structure, and in eager mode the values: :func:`value_problem`). Internal to the
partitions (no ``__all__``)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from positional_lsh.ops.checks import positive_int
from positional_lsh.ops.partitions.schemes import get_scheme


class PartitionFields(Protocol):
    """The fields of a ``Partitions`` as :func:`check_partition_values` reads them (before they are checked)."""

    seq_len: Any
    slopes: Any
    pitch: Any
    shift: Any
    scheme: str
    device: Any
    decays: Any
    decay_len: Any
    max_block: Any


def value_problem(pitch: torch.Tensor, shift: torch.Tensor, integer: bool) -> str | None:
    """What is wrong with these pitch and shift values (float64 CPU tensors of one shape), or ``None``.

    Every pitch must be ``> 0`` and not NaN (``inf``: one block holding the whole sequence), every shift finite with
    ``0 <= shift < pitch``; with ``integer``, finite pitches and all shifts must be integers. The message names the
    first offending (sample, head) and its values. ``O(T*H)``, through numpy (about 3 us at T = 16, H = 8).
    """
    p = pitch.detach().numpy()
    s = shift.detach().numpy()
    # Fast path: 0 <= shift < pitch alone rules out NaN anywhere, pitch <= 0 and an infinite shift (inf < inf is
    # false); floor(inf) == inf, so infinite pitches pass the integer test.
    ok = (s >= 0) & (s < p)
    if integer:
        ok &= (np.floor(p) == p) & (np.floor(s) == s)
    if ok.all():
        return None
    with np.errstate(invalid="ignore"):
        checks = [
            (~(p > 0), "pitch > 0 (or inf: one block)"),
            (~np.isfinite(s) | ~(s >= 0), "a finite shift >= 0"),
            (~(s < p), "shift < pitch"),
        ]
        if integer:
            finite = np.isfinite(p)
            checks.append(((finite & (p != np.floor(np.where(finite, p, 0.0)))) | (s != np.floor(s)),
                           "integer pitches and shifts (the scheme is declared integer)"))  # fmt: skip
    for bad, want in checks:
        if bad.any():
            t, h = (int(i) for i in np.argwhere(bad)[0])
            count = int(bad.sum())
            return (f"pitch={float(p[t, h])!r}, shift={float(s[t, h])!r} at sample {t}, head {h} ({count} such entr"
                    f"{'y' if count == 1 else 'ies'}); expected {want}")  # fmt: skip
    return None


def _as_values(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.is_complex() or x.dtype == torch.bool:
        what = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"Partitions.{name} must be a real tensor, got {what}")
    if x.device.type == "meta":
        raise ValueError(f"Partitions.{name} must hold values (a CPU tensor), got a meta tensor")
    return x


def check_partition_values(p: PartitionFields) -> dict[str, object]:
    """Refuse a :class:`Partitions` whose fields are not what the estimator computes with, and return the checked
    values of the fields that change (``{name: value}``, set by ``Partitions.__post_init__`` before the instance is
    sealed); run once, when one is made (by hand, by ``dataclasses.replace``, ``select``, ``with_seq_len``, or from a
    sampler), raising ``TypeError``/``ValueError`` naming the field.

    * Structure, always (also inside a ``torch.compile`` trace, where it reads shapes only): ``seq_len`` an int
      ``>= 1``; ``pitch`` and ``shift`` real tensors of one shape ``(T, H)`` with ``T, H >= 1``; ``slopes`` ``(H,)``;
      a registered ``scheme``; ``decays`` ``None`` or one per head; ``decay_len`` ``None`` or ``>= seq_len``;
      ``max_block`` ``None`` or an int ``>= 1`` (the ints become Python ints). In eager mode, ``pitch``, ``shift`` and
      ``slopes`` are copied to float64 CPU tensors of the ``Partitions`` (never the caller's: mutating those later
      cannot bypass this check), and a ``device`` given by name becomes a ``torch.device``.
    * Values, in eager mode only (under ``torch.compile`` they come from the draw op, which is trusted, and are not
      read): :func:`value_problem` for the scheme (``get_scheme(scheme).integer``). ``O(T*H)`` numbers; about
      10 us per ``Partitions`` made at T = 16, H = 8.
    """
    compiling = torch.compiler.is_compiling()
    values: dict[str, object] = {}
    seq_len = p.seq_len
    if not (compiling and isinstance(p.seq_len, torch.SymInt)):
        # A Python int from here on (a numpy int64 would reach the kernels' launch arguments).
        values["seq_len"] = seq_len = positive_int("seq_len", p.seq_len)
    pitch, shift = _as_values("pitch", p.pitch), _as_values("shift", p.shift)
    slopes = _as_values("slopes", p.slopes)
    if pitch.dim() != 2 or shift.shape != pitch.shape:
        raise ValueError(
            f"Partitions.pitch and shift must be (num_samples, num_heads) tensors of one shape, got "
            f"{tuple(pitch.shape)} and {tuple(shift.shape)}"
        )
    if not compiling and min(pitch.shape) < 1:
        raise ValueError(f"Partitions need at least one sample and one head, got pitch of shape {tuple(pitch.shape)}")
    if slopes.dim() != 1 or (not compiling and slopes.shape[0] != pitch.shape[1]):
        raise ValueError(f"Partitions.slopes must be ({pitch.shape[1]},), one per head, got {tuple(slopes.shape)}")
    integer = get_scheme(p.scheme).integer
    if p.decays is not None and (not isinstance(p.decays, tuple) or len(p.decays) != pitch.shape[1]):
        raise ValueError(f"Partitions.decays must be None or a tuple of one Decay per head ({pitch.shape[1]})")
    if p.decay_len is not None and not compiling:
        values["decay_len"] = decay_len = positive_int("decay_len", p.decay_len)
        if decay_len < seq_len:
            raise ValueError(f"Partitions.decay_len={decay_len} is below seq_len={seq_len}: the decay "
                             "partitions are exact only up to decay_len")  # fmt: skip
    if p.max_block is not None:
        values["max_block"] = positive_int("max_block", p.max_block)
    if compiling:
        return values
    if not isinstance(p.device, torch.device):
        try:
            values["device"] = torch.device(p.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"Partitions.device must be a torch.device or its name, got {p.device!r}") from exc
    # Always a copy (about 1 us each at T*H = 128): the caller's tensors may change after this check.
    for name, x in (("pitch", pitch), ("shift", shift), ("slopes", slopes)):
        values[name] = x.detach().to("cpu", torch.float64, copy=True)
    problem = value_problem(values["pitch"], values["shift"], integer)  # type: ignore[arg-type]
    if problem is not None:
        raise ValueError(f"Partitions of scheme {p.scheme!r} hold {problem}")
    return values
