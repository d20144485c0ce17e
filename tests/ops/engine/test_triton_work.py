"""The work model of the kernels' count (scripts/triton_work.py): exact against an instrumented interpreter run, and
the targets of issue 17 (integer operations per computed score entry at T = 64; T = 256 against T = 8).

The instrumented run counts, while ``block_count`` runs, every elementwise integer operation Triton's interpreter
executes on a vector or tile (adds, compares, selects, pointer adds; the interpreter's own int32 overflow checks
and scalar arithmetic left out), and the calls of ``block_count``. The model must give the same totals.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from positional_lsh import alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.ops._engine.triton.plan import BlockConfig, block_config, build_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))  # developer tooling, not in the package
from triton_work import count_work

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")
interpreter = pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

from triton.language import semantic  # noqa: E402
from triton.runtime import interpreter as tri  # noqa: E402

from positional_lsh.ops._engine.triton import host as tm  # noqa: E402
from positional_lsh.ops._engine.triton import kernels as tk  # noqa: E402


@pytest.fixture
def counter(monkeypatch):
    """``state``: ``ops`` (integer element operations inside ``block_count``) and ``calls`` (of ``block_count``)."""
    state = {"depth": 0, "checks": 0, "ops": 0, "calls": 0}

    def counted(result):
        if state["depth"] and not state["checks"] and result.data.size > 1:
            state["ops"] += int(result.data.size)
        return result

    builder = tri.InterpreterBuilder
    binary, ternary, addptr = builder.binary_op, builder.ternary_op, builder.create_addptr

    def is_int(handle):
        return handle.dtype.is_int() or handle.dtype.is_bool() or handle.dtype.is_ptr()

    def binary_op(self, lhs, rhs, op):
        result = binary(self, lhs, rhs, op)
        return counted(result) if is_int(lhs) else result  # integer operands (compares give bool)

    def ternary_op(self, cond, lhs, rhs, op):
        result = ternary(self, cond, lhs, rhs, op)
        return counted(result) if is_int(lhs) else result

    monkeypatch.setattr(builder, "binary_op", binary_op)
    monkeypatch.setattr(builder, "ternary_op", ternary_op)
    monkeypatch.setattr(builder, "create_addptr", lambda self, p, o: counted(addptr(self, p, o)))
    check = semantic.TritonSemantic.binary_op_sanitize_overflow_impl

    def overflow_check(*args, **kwargs):  # the interpreter's int32 overflow check: not the kernel's work
        state["checks"] += 1
        try:
            return check(*args, **kwargs)
        finally:
            state["checks"] -= 1

    monkeypatch.setattr(semantic.TritonSemantic, "binary_op_sanitize_overflow_impl", overflow_check)
    inner = tk.block_count

    def block_count(*args, **kwargs):
        state["depth"] += 1
        state["calls"] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            state["depth"] -= 1

    monkeypatch.setattr(tk, "block_count", block_count)  # the kernels look it up at call time (interpreter)
    return state


@interpreter
@pytest.mark.parametrize(
    ("causal", "scheme", "hq", "lq", "lk", "t"),
    [(True, "discrete", 3, 64, 64, 9), (False, "gamma", 2, 30, 61, 7), (False, "discrete", 3, 48, 48, 5)],
)
def test_work_model_equals_an_instrumented_run(monkeypatch, counter, causal, scheme, hq, lq, lk, t):
    cfg = BlockConfig(32, 16, 16, dkdv_m=8, dkdv_n=8)
    monkeypatch.setattr(tm, "config_for", lambda q: cfg)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, lq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, hq, lk, 16, generator=g) for _ in range(2))
    parts = sample_partitions(lk, torch.tensor([0.5, 0.03, 0.1])[:hq], t, scheme=scheme, generator=3)
    layout = build_layout(parts, lq, causal, cfg, torch.device("cpu"))
    fwd, dkdv = count_work(layout, "fwd"), count_work(layout, "dkdv")
    out = plsh_attention(q, k, v, partitions=parts, causal=causal, backend="triton")
    assert (counter["ops"], counter["calls"]) == (int(fwd.ops.sum()), int(fwd.pairs.sum()))
    assert int(fwd.near_pairs.sum()) > 0 and int(fwd.near_pairs.sum()) < int(fwd.pairs.sum())  # both kinds ran
    counter.update(ops=0, calls=0)
    out.sum().backward()  # the dq kernel (the forward's pairs again) and the dk, dv kernel (its sub-tiles)
    assert counter["ops"] == int(fwd.ops.sum() + dkdv.ops.sum())
    calls = int(dkdv.entries.sum()) // (cfg.sub_m * cfg.sub_n)
    assert counter["calls"] == int(fwd.pairs.sum()) + calls


def _per_entry(n, t, causal=True):
    parts = sample_partitions(n, alibi_slopes(32), t, generator=0)
    layout = build_layout(parts, n, causal, block_config(torch.bfloat16, 128, 90), torch.device("cpu"))
    return count_work(layout)


def test_count_costs_few_integer_ops_per_entry_at_n_4096():
    # The target (n = 32768, below) at n = 4096: H = 32 standard slopes, causal, bf16 d = 128 on sm_90.
    # The old kernels counted with 2T operations per entry (128 at T = 64).
    at8, at64, at256 = (_per_entry(4096, t) for t in (8, 64, 256))
    assert at64.per_entry <= 8
    assert at256.per_entry <= 2 * at8.per_entry
    assert float(at64.per_entry_by_head.max()) <= 8


@pytest.mark.slow
def test_count_target_at_n_32768():
    # Issue 17: T = 64, n = 32768, H = 32 standard slopes, causal: <= 8 per entry; T = 256 <= 2x T = 8.
    at8, at64, at256 = (_per_entry(32768, t) for t in (8, 64, 256))
    assert at64.per_entry <= 8
    assert at256.per_entry <= 2 * at8.per_entry
