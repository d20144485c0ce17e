"""``method="auto"``'s rule as docs/implementation.md states it ("Choosing the method"): the tables of what the
decision function chooses over a grid of n and T, five draws per cell, are recomputed here from
``ops._engine.routing.decide`` (the cost model of ``ops/_engine/cost.py`` on the drawn blocks). A change of the cost
model that moves a documented decision fails here, and the words are rewritten with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from positional_lsh import alibi_slopes, sample_partitions
from positional_lsh.ops._engine import cost, routing

pytestmark = pytest.mark.usefixtures("torch_path")  # torch's kernels and their cost model (PLSH_CPU_KERNEL=0)

DOC = Path(__file__).resolve().parents[3] / "docs" / "implementation.md"
DRAWS = 5  # generator = 0 ... 4 per cell
HEADS = 8
CHECKED_UP_TO = 1024  # the rows the test recomputes (the longer ones take most of the time)


def documented(caption: str) -> dict[tuple[int, int], int]:
    """``(n, T) -> draws of DRAWS that take the multiplicity form``, from the table after the line ``caption``."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index(caption) + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    samples = [int(re.fullmatch(r"T = (\d+)", c).group(1)) for c in header[1:]]
    cells = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        n, *row = (c.strip() for c in line.strip("|").split("|"))
        for t, cell in zip(samples, row, strict=True):
            count = {"multiplicity": DRAWS, "samples": 0}.get(cell)
            cells[(int(n), t)] = count if count is not None else int(re.fullmatch(rf"(\d) of {DRAWS}", cell).group(1))
    return cells


def chosen(n: int, t: int, causal: bool) -> int:
    """How many of the DRAWS draws ``method="auto"`` sends to the multiplicity form (CPU route, 8 heads)."""
    q = torch.zeros(1, HEADS, n, 64)
    route = routing.dispatch(q, causal=causal, scale=None, backend="auto", method="auto")
    slopes = alibi_slopes(HEADS)
    decisions = [routing.decide(route, sample_partitions(n, slopes, t, generator=s), HEADS, n).method
                 for s in range(DRAWS)]  # fmt: skip
    return sum(d == "multiplicity" for d in decisions)


@pytest.mark.parametrize(("caption", "causal"), [("Causal calls:", True), ("Bidirectional calls:", False)])
def test_documented_auto_decisions_are_the_decision_functions(caption: str, causal: bool) -> None:
    """Issue 34, item 27: the CHANGELOG said "the multiplicity form from T = 4 on, and at every T >= 2 below
    n = 512", but ``auto`` chose the per-sample path at n = 511, T = 2. The documented table is what it chooses."""
    cells = documented(caption)
    assert {(511, 2), (513, 4), (64, 1), (16384, 64)} <= set(cells)
    wrong = {}
    for (n, t), count in sorted(cells.items()):
        if n <= CHECKED_UP_TO and chosen(n, t, causal) != count:
            wrong[(n, t)] = (count, chosen(n, t, causal))
    assert not wrong, f"(n, T): (documented, chosen) draws of {DRAWS} taking the multiplicity form: {wrong}"


def test_the_rule_depends_on_the_draw_and_on_causality() -> None:
    """The points the issue named, and why no rule in n and T alone is true: at n = 511, T = 2 every draw keeps the
    per-sample path; at n = 1024, T = 4 (causal) draws go both ways; bidirectional calls keep the per-sample path at
    n = 513, T = 4, where causal ones take the multiplicity form."""
    assert chosen(511, 2, causal=True) == 0
    assert 0 < chosen(1024, 4, causal=True) < DRAWS
    assert chosen(513, 4, causal=True) == DRAWS and chosen(513, 4, causal=False) == 0
    assert chosen(4096, 1, causal=True) == 0  # one sample: never the multiplicity form


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
@pytest.mark.parametrize("causal", [True, False])
def test_samples_floor_bounds_every_per_sample_estimate(scheme: str, causal: bool) -> None:
    """``method="auto"`` skips the per-sample plan where the multiplicity form wins even against
    ``cost.samples_floor``: that is the rule's choice only if the floor is at most the plan's estimate, every time
    (slope 0: infinite pitches; short query spans; pitches below 1 from steep slopes)."""
    slopes = torch.cat([alibi_slopes(HEADS), torch.tensor([0.0, 4.0])])
    for n, t, q_len in ((16, 3, 16), (100, 8, 37), (256, 8, 256), (700, 32, 700), (2048, 2, 1)):
        for seed in range(3):
            parts = sample_partitions(n, slopes, t, generator=seed, scheme=scheme)
            plan = routing.samples_plan(parts, 2, q_len, causal)
            floor = cost.samples_floor(parts.pitch, parts.shift, q_len)
            assert 0 < floor <= cost.samples_estimate(plan), (n, t, q_len, seed)
