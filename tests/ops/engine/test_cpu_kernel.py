"""The CPU kernel (ops/_engine/cpu/): its build and PLSH_CPU_KERNEL, its routing row, and its numbers against the
float64 oracles.

* the build: once per session (the ``kernel`` fixture); ``PLSH_CPU_KERNEL=0`` takes the torch path, ``=1`` fails in one
  line where the kernel cannot be built, unset warns once (naming the cause and ``PLSH_CPU_KERNEL=0``) and takes the
  torch path; a bad value is refused;
* the routing: on the CPU the multiplicity form and the exact ops take the kernel by default; float64 and other
  devices are refused with a reason (the torch path), never by a silent fallback;
* the numbers: the multiplicity form (``log c`` from the partitions, integer and real pitches) against the dense
  estimator ``softmax(s + log Mbar) v`` and the autograd gradients of its dense surrogate (slope term included);
  exact and windowed ALiBi against the n x n oracle (forward, ``q, k, v`` and slope gradients); a decay family against
  its float64 reference; causal and bidirectional, GQA, ``Lq < Lk``, bf16/fp16, a ``key_padding_mask``, two threads.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from positional_lsh import alibi_attention, decay_attention, plsh_attention, sample_partitions
from positional_lsh.ops._engine import routing
from positional_lsh.ops._engine.backend import Saved
from positional_lsh.ops._engine.cpu import build
from positional_lsh.ops._engine.cpu.backend import CPU_KERNEL
from positional_lsh.ops._engine.kinds import Kernel
from positional_lsh.ops.exact.reference import alibi_attention_reference
from positional_lsh.ops.partitions.decays import decay_attention_reference

from conftest import dense_surrogate, naive_alibi, naive_estimator, naive_mean_mask

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def kernel() -> build.KernelState:
    """The kernel, built (or loaded from torch's extension cache) once per session."""
    state = build.load_kernel()
    if not state.loaded:
        pytest.fail(f"the CPU kernel did not build on this machine: {state.reason}")
    return state


@pytest.fixture
def clean_state(kernel, monkeypatch):
    """A fresh process's first call (the build's outcome and the warnings forgotten), restored after the test."""
    monkeypatch.delenv(build.ENV, raising=False)
    build.reset()
    yield monkeypatch
    monkeypatch.undo()
    build.reset()
    assert build.load_kernel().loaded  # from the cache: the ops are registered once per process


# --------------------------------------------------------------------------------------------------- the build


def test_plsh_cpu_kernel_0_takes_the_torch_path(kernel, monkeypatch):
    monkeypatch.setenv(build.ENV, "0")
    assert build.kernel_state() == build.KernelState(False, "PLSH_CPU_KERNEL=0")
    q = torch.zeros(1, 2, 8, 16)
    route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="multiplicity")
    assert route.multiplicity is Kernel.FLASH
    assert routing.exact_kernel("auto", q, "alibi_attention") is Kernel.FLASH


def test_a_missing_tool_warns_once_or_fails_in_one_line(clean_state):
    clean_state.setattr(build, "missing_tool", lambda: "ninja is not installed (pip install ninja)")
    with pytest.warns(RuntimeWarning, match="ninja is not installed.*PLSH_CPU_KERNEL=0") as record:
        assert not build.kernel_state().loaded
    assert len(record) == 1 and "\n" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per cause
        assert not build.kernel_state().loaded
        q = torch.zeros(1, 2, 8, 16)
        route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="multiplicity")
        assert route.multiplicity is Kernel.FLASH  # the torch path, decided up front
    clean_state.setenv(build.ENV, "1")
    with pytest.raises(RuntimeError, match=r"^PLSH_CPU_KERNEL=1 but the CPU kernel cannot be built: ninja") as err:
        build.kernel_state()
    assert "\n" not in str(err.value)


def test_a_failed_build_is_reported_not_swallowed(clean_state):
    def fail() -> None:
        raise RuntimeError("Error building extension: attention.cpp:1: error: expected ';'")

    clean_state.setattr(build, "build_kernel", fail)
    with pytest.warns(RuntimeWarning, match="did not build.*expected ';'"):
        assert not build.kernel_state().loaded


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    # torch's O_EXCL lock file outlives a build killed midway; every later process then waited on it forever.
    (tmp_path / "lock").write_text("")
    with build.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_holds_the_directory(tmp_path, capfd):
    fcntl = pytest.importorskip("fcntl")
    with build.build_lock(tmp_path):
        (tmp_path / "lock").write_text("")  # the live build's own torch lock
        with open(tmp_path / "plsh.flock", "a+") as other:  # another process's attempt (a second open file)
            with pytest.raises(BlockingIOError):
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (tmp_path / "lock").exists()  # not removed under a live holder
    with open(tmp_path / "plsh.flock", "a+") as other:  # released on exit
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_bad_value_of_plsh_cpu_kernel_is_refused(monkeypatch):
    monkeypatch.setenv(build.ENV, "yes")
    with pytest.raises(ValueError, match="PLSH_CPU_KERNEL must be 0"):
        build.kernel_state()


# ------------------------------------------------------------------------------------------------- the routing


def test_the_kernel_is_a_routing_row_with_refusals(kernel, monkeypatch):
    monkeypatch.delenv(build.ENV, raising=False)
    assert routing.backend_for("multiplicity", "cpu") is CPU_KERNEL
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.zeros(1, 2, 8, 16, dtype=dtype)
        route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="auto")
        assert (route.samples, route.multiplicity) == (Kernel.FLASH, Kernel.CPU)
        assert routing.exact_kernel("auto", q, "alibi_attention") is Kernel.CPU
    q64 = torch.zeros(1, 2, 8, 16, dtype=F64)
    assert routing.dispatch(q64, causal=True, scale=None, backend="auto", method="auto").multiplicity is Kernel.FLASH
    inputs = routing.Inputs(q64, 8, True)
    assert "float64" in str(routing.refusal(routing.Method.MULTIPLICITY, Kernel.CPU, inputs))
    meta = torch.zeros(1, 2, 8, 16, device="meta")
    assert "on the CPU" in str(routing.cpu_kernel_refusal(meta.device, meta.dtype, 16, 8, 8))
    assert "head dims" in str(routing.cpu_kernel_refusal(torch.device("cpu"), torch.float32, 1024, 8, 8))
    for backend in ("flash", "math"):  # a forced torch kernel is kept
        assert routing.dispatch(q, causal=True, scale=None, backend=backend, method="auto").multiplicity == backend
    parts = sample_partitions(8, [0.5, 0.1], 4, generator=0)
    route = routing.dispatch(q, causal=True, scale=None, backend="auto", method="auto")
    assert routing.decide(route, parts, 2, 8).method == "multiplicity"
    one = sample_partitions(8, [0.5, 0.1], 1, generator=0)
    assert routing.decide(route, one, 2, 8).method == "samples"


# ------------------------------------------------------------------------------------------------- the numbers

# (hq, hkv, lq, lk, T, scheme, causal)
_CASES = [
    (4, 2, 70, 70, 5, "discrete", True),
    (4, 2, 70, 70, 5, "gamma", False),
    (2, 1, 30, 90, 3, "gamma", True),  # Lq < Lk, MQA
    (2, 2, 1, 40, 4, "discrete", False),  # one query (decoding)
    (2, 2, 130, 130, 2, "discrete", False),  # several query tiles and key blocks
]


def _inputs(hq, hkv, lq, lk, t, scheme, seed=0, d=16):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, hq, lq, d), (2, hkv, lk, d), (2, hkv, lk, d), (2, hq, lq, d))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=F64) for s in shapes)
    parts = sample_partitions(lk, [0.5, 0.1, 0.03, 0.0][:hq], t, scheme=scheme, generator=seed + 3)
    return q, k, v, dout, parts


@pytest.mark.parametrize(("hq", "hkv", "lq", "lk", "t", "scheme", "causal"), _CASES)
def test_the_multiplicity_form_equals_the_oracle(kernel, hq, hkv, lq, lk, t, scheme, causal):
    q, k, v, dout, parts = _inputs(hq, hkv, lq, lk, t, scheme)
    scale = 16**-0.5
    qf, kf, vf = (x.float() for x in (q, k, v))
    plan = CPU_KERNEL.plan(parts, hkv, lq, causal, q.device)
    out, lse = CPU_KERNEL.forward(plan, qf, kf, vf, scale)
    dq, dk, dv, dist = CPU_KERNEL.backward(plan, Saved(qf, kf, vf, out, lse), dout.float(), scale, True)
    mbar = naive_mean_mask(parts.pitch, parts.shift, lk)
    oracle = naive_estimator(q, k, v, mbar, causal=causal, scale=scale)
    want = dense_surrogate(q, k, v, dout, mbar, causal=causal, scale=scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), oracle, rtol=0, atol=2e-5)
    for got, ref in zip((dq, dk, dv, dist), want[1:], strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5 * max(1.0, float(ref.abs().max())))
    # lse of the scores plus log c (c = T Mbar): against the dense log-sum-exp
    pos = torch.arange(lk - lq, lk)
    bias = torch.log(mbar[:, lk - lq :] * t)
    if causal:
        bias = bias.masked_fill(torch.arange(lk)[None, :] > pos[:, None], -math.inf)
    s = q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * scale + bias
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=2e-5)


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
@pytest.mark.parametrize("causal", [True, False])
def test_many_tiles_small_blocks_and_many_samples_equal_the_oracle(kernel, scheme, causal):
    # Steep slopes (blocks of a few keys) and T = 40 over five query tiles: every row changes several samples'
    # blocks, which the kernel finds by their ends (integer pitches without a division, real ones by the labels).
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 3, 300, 8, generator=g, dtype=F64) for _ in range(3))
    parts = sample_partitions(300, [1.5, 0.4, 0.05], 40, scheme=scheme, generator=11)
    plan = CPU_KERNEL.plan(parts, 3, 300, causal, q.device)
    out, _ = CPU_KERNEL.forward(plan, q.float(), k.float(), v.float(), 0.5)
    # Mbar from the definition (positions i, j share block floor((i - shift) / pitch)), vectorized over (T, H, n, n)
    pos = torch.arange(300, dtype=F64)
    lab = torch.floor((pos - parts.shift[:, :, None]) / parts.pitch[:, :, None])
    lab = torch.where(torch.isinf(parts.pitch)[:, :, None], 0.0, lab)
    mbar = (lab[:, :, :, None] == lab[:, :, None, :]).to(F64).mean(0)
    oracle = naive_estimator(q, k, v, mbar, causal=causal, scale=0.5)
    torch.testing.assert_close(out.double(), oracle, rtol=0, atol=2e-5)


def _label_mean_mask(parts, n):
    """Mbar from the definition (i, j share block floor((i - shift) / pitch)), one sample at a time."""
    pos = torch.arange(n, dtype=F64)
    mbar = torch.zeros(parts.num_heads, n, n, dtype=F64)
    for t in range(parts.num_samples):
        lab = torch.floor((pos - parts.shift[t][:, None]) / parts.pitch[t][:, None])
        lab = torch.where(torch.isinf(parts.pitch[t])[:, None], 0.0, lab)
        mbar += (lab[:, :, None] == lab[:, None, :]).to(F64)
    return mbar / parts.num_samples


@pytest.mark.parametrize(("t", "scheme"), [(48, "discrete"), (48, "gamma"), (2, "gamma"), (2, "far")])
@pytest.mark.parametrize("causal", [True, False])
def test_the_rows_bookkeeping_over_short_and_long_blocks_equals_the_oracle(kernel, t, scheme, causal):
    # A causal row's block starts are kept run-length encoded and updated row by row: many samples ending at once
    # (blocks of a few keys), a few among many distinct starts (long blocks, T = 48), and two long blocks far apart
    # (T = 2, "far": the starts 0 and 300 when the block [300, 600) ends) each take their own update; eleven query
    # tiles carry the counts over many key blocks. Forward and gradients against the float64 oracle.
    n = 700
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 3, n, 8, generator=g, dtype=F64) for _ in range(4))
    parts = sample_partitions(n, [1.5, 0.02, 0.002], t, scheme="discrete" if scheme == "far" else scheme, generator=13)
    if scheme == "far":
        pitch = torch.tensor([[2.0, 150.0, 1000.0], [1.0, 37.0, 300.0]], dtype=F64)
        parts = dataclasses.replace(parts, pitch=pitch, shift=torch.tensor([[1.0, 3.0, 0.0], [0.0, 5.0, 0.0]]))
    plan = CPU_KERNEL.plan(parts, 3, n, causal, q.device)
    qf, kf, vf = (x.float() for x in (q, k, v))
    out, lse = CPU_KERNEL.forward(plan, qf, kf, vf, 0.5)
    dq, dk, dv, dist = CPU_KERNEL.backward(plan, Saved(qf, kf, vf, out, lse), dout.float(), 0.5, True)
    mbar = _label_mean_mask(parts, n)
    want = dense_surrogate(q, k, v, dout, mbar, causal=causal, scale=0.5)
    oracle = naive_estimator(q, k, v, mbar, causal=causal, scale=0.5)
    torch.testing.assert_close(out.double(), oracle, rtol=0, atol=2e-5)
    for got, ref in zip((dq, dk, dv, dist), want[1:], strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5 * max(1.0, float(ref.abs().max())))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_equal_the_oracle_within_their_rounding(kernel, dtype):
    q, k, v, _, parts = _inputs(4, 2, 70, 70, 6, "discrete")
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out = plsh_attention(q, k, v, partitions=parts, causal=True)
    assert out.dtype == dtype
    oracle = naive_estimator(q, k, v, naive_mean_mask(parts.pitch, parts.shift, 70), causal=True)
    # The output's rounding to the dtype (relative eps / 2) and, in bfloat16, the probabilities' rounding for P V:
    # |sum_j p_j e_j v_j| <= eps / 2 * max |v|. Twice both.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), oracle, rtol=eps, atol=eps * float(v.abs().max()))


def test_the_op_runs_the_kernel_with_autograd_and_padding(kernel, monkeypatch):
    q, k, v, dout, parts = _inputs(4, 2, 70, 70, 5, "discrete")
    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, :13] = False  # left padding of the second row
    got = plsh_attention(q, k, v, partitions=parts, causal=True, key_padding_mask=mask)
    grads = torch.autograd.grad(got, (q, k, v), dout.float())
    monkeypatch.setenv(build.ENV, "0")  # the torch path (tested against the oracles elsewhere)
    want = plsh_attention(q, k, v, partitions=parts, causal=True, key_padding_mask=mask)
    wgrads = torch.autograd.grad(want, (q, k, v), dout.float())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(grads, wgrads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 9.5])
def test_exact_alibi_equals_the_oracle(kernel, causal, window):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 50, 16, generator=g, dtype=F64)
    k, v = (torch.randn(2, 2, 80, 16, generator=g, dtype=F64) for _ in range(2))
    dout = torch.randn(2, 4, 50, 16, generator=g, dtype=F64)
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=F64)
    win = None if window is None else torch.full((4,), window, dtype=F64)
    qf, kf, vf, sf = (x.float().requires_grad_() for x in (q, k, v, slopes))
    out = alibi_attention(qf, kf, vf, sf, causal=causal, window=window)
    got = torch.autograd.grad(out, (qf, kf, vf, sf), dout.float())
    oracle = naive_alibi(q, k, v, slopes, causal=causal, window=win)
    torch.testing.assert_close(out.double(), oracle, rtol=0, atol=2e-5)
    qd, kd, vd, sd = (x.clone().requires_grad_() for x in (q, k, v, slopes))
    ref = alibi_attention_reference(qd, kd, vd, sd, causal=causal, window=window)
    want = torch.autograd.grad(ref, (qd, kd, vd, sd), dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=2e-5 * max(1.0, float(b.abs().max())))


def test_a_decay_family_equals_its_reference(kernel):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, dtype=F64) for _ in range(3))
    params = torch.tensor([[0.3, 1.5], [0.1, 0.7]], dtype=F64)
    try:
        out = decay_attention(q.float(), k.float(), v.float(), "power", params, causal=True)
    except ValueError as err:  # the family's parameters differ: skip rather than guess them
        pytest.skip(f"power decay parameters: {err}")
    ref = decay_attention_reference(q, k, v, "power", params, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


def test_two_threads_give_the_same_numbers(kernel):
    # Each tile (forward) and each (batch, query head) (backward) is computed by one thread, and a key head's dk, dv
    # are summed over its query heads in one order: two threads give the same bits, GQA included.
    q, k, v, dout, parts = _inputs(4, 2, 200, 200, 8, "discrete")
    qf, kf, vf = (x.float() for x in (q, k, v))
    plan = CPU_KERNEL.plan(parts, 2, 200, True, q.device)

    def run() -> tuple[torch.Tensor, ...]:
        out, lse = CPU_KERNEL.forward(plan, qf, kf, vf, 0.25)
        grads = CPU_KERNEL.backward(plan, Saved(qf, kf, vf, out, lse), dout.float(), 0.25, True)
        return out, lse, *grads

    one = run()
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = run()
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    mbar = naive_mean_mask(parts.pitch, parts.shift, 200)
    want = dense_surrogate(q, k, v, dout, mbar, causal=True, scale=0.25)
    for got, ref in zip(two[2:], want[1:], strict=True):  # and they are the oracle's
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5 * max(1.0, float(ref.abs().max())))


def test_the_kernel_runs_on_every_thread(kernel):
    # at::parallel_for is compiled into the kernel: built without the parallel backend's flags it ran on one thread
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.ops.plsh_cpu.parallel_threads() == 2
    finally:
        torch.set_num_threads(prev)


def test_kept_bias_tables_follow_the_slopes_window_and_length(kernel):
    # The kernel's ALiBi tables are kept between calls: calls that alternate slopes, windows and key lengths each
    # equal their own oracle (a table kept for other values would fail this), and a decay family's does not collide.
    # 300 and 200 keys: several of the exact forward's tiles and key blocks (TABLE_BLOCK_M/N), a partial last one.
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=F64) for _ in range(3))
    cases = [([0.5, 0.01], None, 300), ([0.25, 0.005], None, 300), ([0.5, 0.01], 150.0, 300), ([0.5, 0.01], None, 200)]
    for slopes, window, n in cases + cases[::-1]:
        s = torch.tensor(slopes, dtype=F64)
        win = None if window is None else torch.full((2,), window, dtype=F64)
        qs, ks, vs = (x[:, :, :n] for x in (q, k, v))
        got = alibi_attention(qs.float(), ks.float(), vs.float(), s.float(), window=window)
        want = naive_alibi(qs, ks, vs, s, causal=True, window=win)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    params = torch.tensor([[0.5, 1.0], [0.5, 1.0]], dtype=F64)
    got = decay_attention(q.float(), k.float(), v.float(), "power", params.float(), causal=True)
    torch.testing.assert_close(got.double(), decay_attention_reference(q, k, v, "power", params, causal=True),
                               rtol=0, atol=2e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["plsh", "alibi"])
def test_a_nan_query_makes_its_row_nan_and_no_other(kernel, dtype, op):
    # The softmax's running max does not propagate NaN itself: a NaN query row must still come out NaN, also where
    # it keeps a single key (row 0; the block's other lanes padding) or few (steep slopes), and every other row must
    # be exactly the clean call's.
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 200, 16, generator=g).to(dtype) for _ in range(3))
    slopes = torch.tensor([1.5, 0.05])
    parts = sample_partitions(200, slopes, 8, generator=1)

    def run(x: torch.Tensor) -> torch.Tensor:
        if op == "plsh":
            return plsh_attention(x, k, v, partitions=parts)
        return alibi_attention(x, k, v, slopes, window=torch.tensor([3.0, 1e9]))

    bad = [0, 1, 63, 64, 130, 199]
    qn = q.clone()
    qn[0, :, bad] = float("nan")
    clean, out = run(q), run(qn)
    rows = torch.zeros(200, dtype=torch.bool)
    rows[bad] = True
    assert bool(out[0, :, rows].isnan().all())
    assert torch.equal(out[0, :, ~rows], clean[0, :, ~rows])


def test_a_long_context_buffer_is_given_back_and_rebuilt(kernel):
    # A key head over 64 MiB (the size a thread keeps its packing buffer across calls) is given back after the call:
    # the next calls, long and short, rebuild theirs and still equal the oracle.
    g = torch.Generator().manual_seed(8)
    lk, lq = 270_000, 8
    q = torch.randn(1, 1, lq, 64, generator=g)
    k, v = (torch.randn(1, 1, lk, 64, generator=g) for _ in range(2))
    slopes = torch.tensor([0.5])
    for _ in range(2):
        out = alibi_attention(q, k, v, slopes, window=torch.tensor([40.0]))
        want = naive_alibi(q.double(), k[:, :, -200:].double(), v[:, :, -200:].double(), slopes.double(),
                           causal=True, window=torch.tensor([40.0], dtype=F64))  # fmt: skip
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
        short = alibi_attention(q, k[:, :, :100], v[:, :, :100], slopes)
        ref = naive_alibi(q.double(), k[:, :, :100].double(), v[:, :, :100].double(), slopes.double(), causal=True)
        torch.testing.assert_close(short.double(), ref, rtol=0, atol=2e-5)
