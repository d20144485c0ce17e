"""positional_lsh.ops.partitions.bounds: the one block_bounds, against Partitions.labels() for every kind of partition.

The reference is ``labels()`` itself: the block of position ``i`` is the set of positions with ``i``'s label (dense,
``n <= 300``). At lengths where ``labels()`` cannot be built, the label formula of ``labels()`` evaluated at a
position and its neighbours on both sides of each bound (the float64 ``floor((i - shift) / pitch)``, ``torch.floor``,
not the code under test's ``exact_floor``) certifies the bounds: labels never decrease along positions. Then every
caller (``Partitions.block_span``, the multiplicity plan and masks, decoding, the Triton plan) is shown to ask
``block_bounds`` and to get its blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import positional_lsh.ops._decode as decode
import positional_lsh.ops._engine.triton.plan as triton_plan
import positional_lsh.ops.partitions.partition as partition
from positional_lsh import Partitions, get_scheme, plsh_attention, sample_partitions, scheme_names
from positional_lsh.ops._engine.multiplicity import mask as mult
from positional_lsh.ops._engine.multiplicity.plan import multiplicity_plan, tile_rows
from positional_lsh.ops.partitions import bounds
from positional_lsh.ops.partitions.bounds import MAX_SEQ_LEN, block_bounds, exact_floor, integer_pitch_shift
from positional_lsh.ops.partitions.decays import exponential_decay, power_decay, truncated_linear_decay

CI = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "derandomize": True, "database": None}

# Ordinary slopes, slope 0 (pitch inf), large ones (pitch about 1 or below: single positions), tiny ones (pitches of
# 2**51 to 2**53 and beyond) and subnormal ones (pitches near the float64 maximum, or overflowing to inf).
ORDINARY = [0.5, 0.1, 0.03, 0.0, 0.9]
HUGE = [10.0, 1e3, 1e6]
TINY = [2.0**-50, 2.0**-51, 2.0**-52, 1e-17, 1e-20]
SUBNORMAL = [1e-300, 1e-305, 1e-308, 1e-310, 5e-324]


def _from_labels(parts: Partitions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` ``(T, H, n)`` of every position's block, from ``labels()`` by comparing labels only."""
    lab = parts.labels()
    pos = torch.arange(parts.seq_len)
    same = lab[..., :, None] == lab[..., None, :]  # (T, H, n, n)
    start = torch.where(same, pos, parts.seq_len).amin(-1)
    end = torch.where(same, pos, -1).amax(-1) + 1
    return start, end


def _assert_labels(parts: Partitions) -> None:
    n = parts.seq_len
    start, end = block_bounds(parts.pitch[..., None], parts.shift[..., None], n, torch.arange(n))
    want_start, want_end = _from_labels(parts)
    assert start.dtype == end.dtype == torch.int64
    bad = (start != want_start) | (end != want_end)
    if bad.any():
        t, h, i = (int(x) for x in torch.nonzero(bad)[0])
        raise AssertionError(
            f"pitch={float(parts.pitch[t, h])!r} shift={float(parts.shift[t, h])!r} n={parts.seq_len} position {i}: "
            f"block_bounds [{int(start[t, h, i])}, {int(end[t, h, i])}), labels() "
            f"[{int(want_start[t, h, i])}, {int(want_end[t, h, i])})"
        )


def _label(pitch: torch.Tensor, shift: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """The labels() formula at positions ``i`` (float64, torch.floor; pitch inf: label 0)."""
    lab = torch.floor((i.to(torch.float64) - shift) / pitch)
    return torch.where(torch.isinf(pitch), torch.zeros_like(lab), lab)


def _assert_certified(pitch: torch.Tensor, shift: torch.Tensor, n: int, pos: torch.Tensor) -> None:
    """Spot positions of a long sequence: the labels on both sides of each bound are those of a block holding pos."""
    start, end = block_bounds(pitch, shift, n, pos)
    pitch, shift, pos = torch.broadcast_tensors(pitch, shift, pos)
    assert bool(((start <= pos) & (pos < end) & (start >= 0) & (end <= n)).all())
    lab = _label(pitch, shift, pos)
    assert torch.equal(_label(pitch, shift, start), lab) and torch.equal(_label(pitch, shift, end - 1), lab)
    assert bool(((start == 0) | (_label(pitch, shift, start - 1) < lab)).all())
    assert bool(((end == n) | (_label(pitch, shift, end) > lab)).all())


def _parts(n: int, pitch: list[list[float]], shift: list[list[float]], scheme: str) -> Partitions:
    p = torch.tensor(pitch, dtype=torch.float64)
    s = torch.tensor(shift, dtype=torch.float64)
    return Partitions(n, torch.full((p.shape[1],), 0.1, dtype=torch.float64), p, s, scheme)


@pytest.mark.parametrize("scheme", scheme_names())
def test_every_scheme_gives_the_blocks_of_labels(scheme):
    for n, slopes in ((300, ORDINARY), (97, HUGE + TINY), (64, [*SUBNORMAL, 0.2])):
        _assert_labels(sample_partitions(n, torch.tensor(slopes), 6, scheme=scheme, generator=n))


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
def test_capped_draws_give_the_blocks_of_labels(scheme):
    slopes = torch.tensor([1e-3, 1e-6, 0.0, 0.3, *SUBNORMAL[:3], *TINY[:2]])
    for n, cap in ((200, 16), (150, 1), (120, 7), (90, 2**53), (90, 2**51 + 1)):
        parts = sample_partitions(n, slopes, 5, scheme=scheme, generator=cap % 1000, max_block=cap)
        assert bool((parts.pitch <= cap).all())
        _assert_labels(parts)


def test_decay_partitions_give_the_blocks_of_labels():
    for decay in (power_decay(0.5, 1.0), truncated_linear_decay(4.5), exponential_decay(0.2)):
        for cap in (None, 5):
            parts = sample_partitions(250, None, 8, decay=[decay, decay], generator=3, max_block=cap)
            assert parts.decays is not None
            _assert_labels(parts)
    # A heavy tail: whole-sequence blocks (pitch inf) among the finite ones.
    parts = sample_partitions(120, None, 16, decay=power_decay(0.05, 0.05), generator=1)
    assert bool(torch.isinf(parts.pitch).any() and torch.isfinite(parts.pitch).any())
    _assert_labels(parts)


def _below(pitch: float) -> float:
    """The largest integer shift below an integer pitch (5 for inf)."""
    if math.isinf(pitch):
        return 5.0
    return pitch - 1.0 if pitch <= 2.0**53 else math.nextafter(pitch, 0.0)


def test_hand_made_pitches_give_the_blocks_of_labels():
    n = 80
    big = [2.0**51, 2.0**51 + 1, 2.0**52 + 1, 2.0**53 - 1, 2.0**53, 2.0**53 + 2, 2.0**60, 1e300, math.inf]
    # Integer pitches (one scheme flag on), each with shifts below n, at n, and just below the pitch.
    pitch = [[p for p in big for _ in range(4)]]
    shift = [[s for p in big for s in (0.0, 37.0, float(n), _below(p))]]
    _assert_labels(_parts(n, pitch, shift, "discrete"))
    # Real shifts under the same pitches, real pitches near 1 and between 1 and 2, tiny ones, and inf with a shift.
    pitch = [[2.0**51, 2.0**53, 1e300, 1.5, 1.0 + 2**-40, 1.0, 1 - 2**-53, 0.3, 1e-9, math.inf, 7.25, 3.0]]
    shift = [[36.5, 2.0**52 - 0.5, 5e299, 1.4999, 1.0, 0.999, 0.5, 0.25, 5e-10, 3.5, 7.0, 2.0]]
    _assert_labels(_parts(n, pitch, shift, "gamma"))


def test_spot_positions_of_long_sequences():
    g = torch.Generator().manual_seed(0)
    for n in (2**31 - 1, 2**40 + 7, MAX_SEQ_LEN):
        slopes = torch.tensor([1e-9, 1e-12, 2.0**-51, 0.0, 0.05, *SUBNORMAL[:3]])
        for scheme in ("discrete", "gamma", "discrete-strat"):
            parts = sample_partitions(n, slopes, 6, scheme=scheme, generator=1)
            pitch, shift = parts.pitch[..., None], parts.shift[..., None]
            pos = torch.cat([torch.randint(0, n, (50,), generator=g), torch.tensor([0, 1, n - 2, n - 1])])
            _assert_certified(pitch, shift, n, pos)
            # Positions at and around the block boundaries inside the sequence.
            start, end = block_bounds(pitch, shift, n, pos)
            edges = torch.cat([start - 1, start, end - 1, end], -1).clamp(0, n - 1)
            _assert_certified(pitch, shift, n, edges)


def test_integer_path_rule():
    # Every integer scheme's draw takes it (slope 0 and subnormal slopes included); a real value not.
    slopes = torch.tensor(ORDINARY + TINY + SUBNORMAL + HUGE)
    for scheme in scheme_names():
        parts = sample_partitions(50, slopes, 4, scheme=scheme, generator=0)
        whole = integer_pitch_shift(parts.pitch, parts.shift)
        assert (whole is not None) == get_scheme(scheme).integer  # the slope 0.03 gives real pitches otherwise
    assert integer_pitch_shift(*_shaped([[2.0**60, 3.0]], [[2.0**59, 1.0]])) is not None
    assert integer_pitch_shift(*_shaped([[math.inf]], [[2.5]])) is not None  # inf: one block, whatever the shift
    for pitch, shift in (([[3.0, 0.5]], [[1.0, 0.0]]), ([[3.0]], [[1.5]]), ([[2.5]], [[1.0]])):
        assert integer_pitch_shift(*_shaped(pitch, shift)) is None  # a pitch below 1 or a real value
    b, s = integer_pitch_shift(*_shaped([[2.0**60, math.inf, 5.0]], [[2.0**59, 3.0, 4.0]]))
    assert b.dtype == s.dtype == torch.int64
    assert b.tolist() == [[2**53, 2**53, 5]] and s.tolist() == [[2**53 - 1, 0, 4]]


def _shaped(pitch: list[list[float]], shift: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(pitch, dtype=torch.float64), torch.tensor(shift, dtype=torch.float64)


def test_exact_floor():
    x = torch.cat([torch.randn(10000, dtype=torch.float64) * 1e6, torch.arange(-50, 50, dtype=torch.float64) / 7,
                   torch.tensor([2.0**51 - 0.5, -(2.0**51), math.inf, -math.inf, -0.0])])  # fmt: skip
    assert torch.equal(exact_floor(x), torch.floor(x))


def test_bad_arguments():
    pitch, shift = _shaped([[3.0]], [[1.0]])
    with pytest.raises(TypeError, match="pos"):
        block_bounds(pitch, shift, 10, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="pitch"):
        block_bounds(pitch.float(), shift, 10, torch.tensor([1]))
    with pytest.raises(TypeError, match="seq_len"):
        block_bounds(pitch, shift, 10.0, torch.tensor([1]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len"):
        block_bounds(pitch, shift, MAX_SEQ_LEN + 1, torch.tensor([1]))


def _draw_pitch(draw: st.DrawFn) -> tuple[float, float]:
    pitch = draw(st.one_of(
        st.integers(1, 40).map(float), st.floats(1e-9, 50.0), st.floats(1.0, 3.0),
        st.sampled_from([math.inf, 2.0**51, 2.0**53 - 1, 2.0**53, 2.0**60, 1e300, 1.0, 0.5]),
    ))  # fmt: skip
    if math.isinf(pitch):
        return pitch, draw(st.sampled_from([0.0, 3.0, 2.5]))
    kind = draw(st.sampled_from(["integer", "real", "edge"]))
    if kind == "integer" and pitch >= 1:
        return pitch, float(draw(st.integers(0, min(int(pitch), 2**53) - 1)))
    if kind == "edge":
        return pitch, math.nextafter(pitch, 0.0)
    return pitch, draw(st.floats(0.0, pitch, exclude_max=True))


@st.composite
def _partitions(draw: st.DrawFn) -> Partitions:
    n = draw(st.integers(1, 120))
    t, h = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    values = [[_draw_pitch(draw) for _ in range(h)] for _ in range(t)]
    pitch = [[p for p, _ in row] for row in values]
    shift = [[s for _, s in row] for row in values]
    integer = all((math.isinf(p) or p.is_integer()) and s.is_integer() for row in values for p, s in row)
    return _parts(n, pitch, shift, "discrete" if integer else "gamma")


@settings(max_examples=150, **CI)
@given(_partitions())
def test_property_block_bounds_equal_labels(parts):
    _assert_labels(parts)


# ------------------------------------------------------------------------------------------------------------------
# Every caller asks block_bounds, and gets its blocks
# ------------------------------------------------------------------------------------------------------------------


def _recording(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Replace ``block_bounds`` in every caller's module by a counting wrapper of the real one."""
    calls: dict[str, int] = {}
    for name, module in (("partition", partition), ("multiplicity", mult), ("decode", decode),
                         ("triton_plan", triton_plan)):  # fmt: skip
        assert module.block_bounds is bounds.block_bounds

        def wrapper(*args: object, _name: str = name) -> tuple[torch.Tensor, torch.Tensor]:
            calls[_name] = calls.get(_name, 0) + 1
            return bounds.block_bounds(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(module, "block_bounds", wrapper)
    return calls


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
def test_every_caller_uses_block_bounds(scheme, monkeypatch):
    n, lq = 150, 140
    parts = sample_partitions(n, torch.tensor([0.3, 0.0, 0.05, 1e-310]), 5, scheme=scheme, generator=4)
    start, end = block_bounds(parts.pitch[..., None], parts.shift[..., None], n, torch.arange(n))  # (T, H, n)
    calls = _recording(monkeypatch)

    # Partitions.block_span: the union over samples.
    j = torch.arange(0, n, 7)
    for h in range(parts.num_heads):
        lo, hi = parts.block_span(h, j)
        assert torch.equal(lo, start[:, h, j].amin(0)) and torch.equal(hi, end[:, h, j].amax(0))
    # The multiplicity plan (tilings) and its masks (row_bounds), on both of row_bounds' paths.
    for causal in (True, False):
        plan = multiplicity_plan(parts, list(range(parts.num_heads)), parts.num_heads, lq, causal)
        for g in plan.groups:
            rows, _ = tile_rows(g, lq)
            pos = rows + (n - lq)  # (N, tile)
            # The plan keeps each head's distinct (pitch, shift) pairs, weighted by how many samples drew each:
            # column u of tile a is sample t_idx[a, u] of its head.
            same = (parts.pitch.t()[g.head][:, None, :] == g.pitch[..., None]) & (
                parts.shift.t()[g.head][:, None, :] == g.shift[..., None]
            )  # (N, U, T)
            assert torch.equal(same.sum(-1).to(torch.int32)[g.weight > 0], g.weight[g.weight > 0])
            assert bool((g.weight.sum(1) == parts.num_samples).all()) and bool(same.any(-1).all())
            t_idx = same.to(torch.int8).argmax(-1)  # (N, U)
            want_start = start[t_idx[:, None, :], g.head[:, None, None], pos[..., None]]  # (N, tile, U)
            want_end = end[t_idx[:, None, :], g.head[:, None, None], pos[..., None]]
            for forced in (False, True):
                with monkeypatch.context() as m:
                    if forced:  # the general path (labels and running max/min) also for integer pitches
                        m.setattr(mult, "integer_pitch_shift", lambda pitch, shift: None)
                    got_start, got_end = mult.row_bounds(g, pos, n, True)
                assert torch.equal(got_start, want_start) and torch.equal(got_end, want_end)
    # Decoding and the Triton plan (torch only).
    q = torch.randn(1, parts.num_heads, 3, 4, dtype=torch.float64)
    k = torch.randn(1, parts.num_heads, n, 4, dtype=torch.float64)
    torch.testing.assert_close(
        decode.decode_rows(q, k, k, parts), plsh_attention(q, k, k, partitions=parts), rtol=0, atol=1e-12
    )
    config = triton_plan.block_config(torch.float32, 64)
    triton_plan.build_layout(parts, lq, False, config, torch.device("cpu"))
    for h in range(parts.num_heads):
        got = triton_plan.head_bounds(parts.pitch[:, h], parts.shift[:, h], n, torch.arange(n))
        assert torch.equal(got[0], start[:, h]) and torch.equal(got[1], end[:, h])
    assert set(calls) == {"partition", "multiplicity", "decode", "triton_plan"}, calls


def _python_blocks(b: int, s: int, n: int, i: int) -> tuple[int, int]:
    """The block of position ``i`` for integer pitch ``b`` and shift ``s``, in Python's exact integers."""
    lab = (i - s) // b
    return max(0, s + lab * b), min(n, s + (lab + 1) * b)


def test_float32_integer_path_is_exact_up_to_its_bound():
    # The float32 route of the integer path (n <= FLOAT32_SEQ_LEN) against exact integer arithmetic, at the largest n
    # it takes and one past it (the int64 route), for pitches around 2**23 and 2**24 and shifts at their extremes:
    # the cases where float32 has no bits to spare.
    for n in (bounds.FLOAT32_SEQ_LEN, bounds.FLOAT32_SEQ_LEN + 1):
        pitches = [1, 2, 3, 7, 2**22 + 1, 2**23 - 1, 2**23, 2**23 + 1, 2**24 - 1, 2**24, 2**24 + 1, 2**25 + 3, 2**53]
        cases = [(b, s) for b in pitches for s in sorted({0, 1, b // 2, b - 1, min(b - 1, n - 1), min(b - 1, n)})]
        pitch = torch.tensor([[float(b) for b, _ in cases]], dtype=torch.float64)
        shift = torch.tensor([[float(s) for _, s in cases]], dtype=torch.float64)
        pos = torch.tensor([0, 1, 2, 3, n // 2, n // 2 + 1, n - 3, n - 2, n - 1] + [s for _, s in cases if s < n])
        start, end = block_bounds(pitch[..., None], shift[..., None], n, pos)
        for c, (b, s) in enumerate(cases):
            for j, i in enumerate(pos.tolist()):
                assert (int(start[0, c, j]), int(end[0, c, j])) == _python_blocks(b, s, n, i), (n, b, s, i)
