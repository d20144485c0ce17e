"""Property tests of the op layer (hypothesis): any input ``plsh_attention`` accepts gives the oracle's answer.

Hostile inputs are drawn on purpose — slopes of 0, subnormal, tiny, huge, negative or NaN; hand-built partitions
with arbitrary (also invalid) pitches and shifts, under every scheme label; capped and decay partitions; every
method, both causal modes, ``Lq < Lk``, grouped-query heads, odd scales. A call either raises ``TypeError`` or
``ValueError`` (a refusal naming the argument), or returns what the float64 oracle of tests/conftest.py
(``naive_mean_mask`` + ``naive_estimator``: Python loops from the definitions) computes from the same partitions,
forward and backward. Any other exception fails. Examples are tiny (``n <= 20``) and few, so this runs in CI.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from positional_lsh import Partitions, plsh_attention, sample_partitions, scheme_names
from positional_lsh.ops.options import METHODS
from positional_lsh.ops.partitions.decays import power_decay

from conftest import naive_estimator, naive_mean_mask

# Reproducible (derandomize) and writing nothing (no example database): the same examples in CI every time.
CI = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "derandomize": True, "database": None}

# Slopes a user may pass: the ordinary range and every edge that broke something once (0: one block; subnormal: the
# pitch overflows to inf; tiny: pitches beyond 2**63; huge: every position its own block), and invalid ones.
SLOPES = st.one_of(
    st.floats(0.01, 2.0),
    st.sampled_from([0.0, 1e-310, 5e-324, 2e-308, 1e-20, 1e-9, 50.0, 1e300]),
    st.sampled_from([-0.5, math.nan, math.inf]),
)
# Pitch and shift values of hand-built partitions: valid ones and nonsense.
PITCHES = st.one_of(st.integers(1, 30).map(float), st.floats(0.05, 40.0), st.sampled_from([math.inf, 1e300, 2.0**60]),
                    st.sampled_from([0.0, -3.0, math.nan]))  # fmt: skip
SHIFTS = st.one_of(st.integers(0, 30).map(float), st.floats(0.0, 40.0), st.sampled_from([-1.0, math.nan, math.inf]))


@st.composite
def calls(draw: st.DrawFn) -> dict:
    """One ``plsh_attention`` call: inputs, options, and either sampling arguments or given partitions."""
    b, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * group
    lk = draw(st.integers(1, 20))
    lq = draw(st.integers(1, lk))
    d = draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    spread = draw(st.sampled_from([0.1, 1.0, 4.0]))
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64) * spread
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64) * spread
    v = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64)
    kw: dict = {
        "causal": draw(st.booleans()),
        "method": draw(st.sampled_from(METHODS)),
        "scale": draw(st.one_of(st.none(), st.floats(1e-3, 10.0))),
    }
    t = draw(st.integers(1, 6))
    how = draw(st.sampled_from(["sample", "given-drawn", "given-by-hand", "decay"]))
    slopes = draw(st.lists(SLOPES, min_size=hq, max_size=hq))
    scheme = draw(st.sampled_from(scheme_names()))
    if how == "sample":
        kw.update(slopes=slopes, num_samples=t, scheme=scheme, generator=draw(st.integers(0, 2**40)))
        return {"q": q, "k": k, "v": v, "kw": kw}
    try:  # building partitions is part of the input: a refusal here is a refusal of the call
        if how == "given-drawn":
            cap = draw(st.one_of(st.none(), st.integers(1, 25)))
            parts = sample_partitions(lk, slopes, t, scheme=scheme, generator=draw(st.integers(0, 2**40)),
                                      max_block=cap)  # fmt: skip
        elif how == "decay":
            heads = [power_decay(draw(st.floats(0.2, 3.0)), draw(st.floats(0.05, 2.0))) for _ in range(hq)]
            parts = sample_partitions(lk, None, t, decay=heads, generator=draw(st.integers(0, 2**40)))
        else:
            pitch = torch.tensor(draw(st.lists(st.lists(PITCHES, min_size=hq, max_size=hq), min_size=t, max_size=t)))
            shift = torch.tensor(draw(st.lists(st.lists(SHIFTS, min_size=hq, max_size=hq), min_size=t, max_size=t)))
            safe = torch.where(torch.isfinite(pitch) & (pitch > 0), pitch, torch.ones_like(pitch))
            if draw(st.booleans()):  # mostly valid shifts, so that many hand-built partitions are accepted
                shift = torch.where(torch.isfinite(shift) & (shift >= 0), torch.remainder(shift, safe), shift)
            parts = Partitions(lk, torch.full((hq,), 0.1, dtype=torch.float64), pitch, shift, scheme)
            if draw(st.booleans()):
                parts = dataclasses.replace(parts, scheme=draw(st.sampled_from(scheme_names())))
    except (TypeError, ValueError):
        return {"refused": True}
    kw["partitions"] = parts
    return {"q": q, "k": k, "v": v, "kw": kw}


def _oracle(q, k, v, parts: Partitions, causal: bool, scale) -> torch.Tensor:
    mbar = naive_mean_mask(parts.pitch, parts.shift, parts.seq_len)
    return naive_estimator(q, k, v, mbar, causal=causal, scale=scale)


def _run(call: dict) -> tuple[torch.Tensor, Partitions] | None:
    """The call's output and the partitions it used, or ``None`` when it was refused (TypeError/ValueError)."""
    kw = dict(call["kw"])
    if "partitions" not in kw:  # draw them as plsh_attention would, to hand the same ones to the oracle
        try:
            out = plsh_attention(call["q"], call["k"], call["v"], **kw)
        except (TypeError, ValueError):
            return None
        parts = sample_partitions(call["k"].shape[2], kw["slopes"], kw["num_samples"], scheme=kw["scheme"],
                                  generator=kw["generator"])  # fmt: skip
        return out, parts
    try:
        return plsh_attention(call["q"], call["k"], call["v"], **kw), kw["partitions"]
    except (TypeError, ValueError):
        return None


@settings(max_examples=60, **CI)
@given(calls())
def test_every_accepted_call_equals_the_oracle(call: dict) -> None:
    if call.get("refused"):
        return
    result = _run(call)
    if result is None:
        return
    out, parts = result
    kw = call["kw"]
    want = _oracle(call["q"], call["k"], call["v"], parts, kw["causal"], kw["scale"])
    assert out.shape == want.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, want, atol=1e-9, rtol=1e-9)


@settings(max_examples=25, **CI)
@given(calls())
def test_every_accepted_call_has_the_oracles_gradients(call: dict) -> None:
    if call.get("refused"):
        return
    q, k, v = (call[x].clone().requires_grad_() for x in ("q", "k", "v"))
    result = _run({**call, "q": q, "k": k, "v": v})
    if result is None:
        return
    out, parts = result
    weights = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    kw = call["kw"]
    want = torch.autograd.grad((_oracle(q, k, v, parts, kw["causal"], kw["scale"]) * weights).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-8)


@settings(max_examples=20, **CI)
@given(calls())
def test_float32_calls_are_close_to_the_oracle(call: dict) -> None:
    if call.get("refused"):
        return
    q, k, v = (call[x].float() for x in ("q", "k", "v"))
    result = _run({**call, "q": q, "k": k, "v": v})
    if result is None:
        return
    out, parts = result
    kw = call["kw"]
    want = _oracle(call["q"], call["k"], call["v"], parts, kw["causal"], kw["scale"])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=2e-4, rtol=2e-4)
