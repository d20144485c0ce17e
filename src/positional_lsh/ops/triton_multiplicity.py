"""The multiplicity form as Triton kernels: one launch for the forward, two for the backward (the GPU path).

Same estimator as :mod:`positional_lsh.ops.multiplicity` (docs/implementation.md, "The multiplicity form")::

    out_i = softmax_j(scale * q_i . k_j + log c[i,j]) v_j

with ``c[i,j] = #{t : start_t(i) <= j}`` for ``j <= i`` when causal (0 above the diagonal) and
``c[i,j] = #{t : start_t(i) <= j < end_t(i)}`` when bidirectional; ``log 0 = -inf``.

Host side (torch, on the tensors' device, ``O(H * Lq * T)``): the exact block bounds of every query row in
every sample (:func:`~positional_lsh.ops.multiplicity.sample_bounds`), stored ``int32 (Hq, T, Lq)`` so that
one sample's bounds of a tile's rows are one contiguous load, and each row's key interval
``[row_lo, row_hi)`` = ``[min_t start_t(i), max_t end_t(i))`` (``i + 1`` causal). Both ends are nondecreasing
in ``i``, so a tile's keys are ``[row_lo[first row], row_hi[last row])`` and the query rows reaching a key
block are one interval, found by ``searchsorted``.

Kernels (flash-attention structure, fp32 accumulation, ``c`` recomputed in registers from the ``T`` bounds —
no ``n x n`` or tile x window mask ever exists in memory):

* ``_fwd``: grid ``(query tiles, B * Hq)``; online softmax over the key blocks of the tile's interval;
  writes ``out`` (input dtype) and ``lse`` (fp32, natural log of ``sum_j c[i,j] e^{s[i,j]}``).
* ``_bwd_dkdv``: grid ``(key blocks, B * Hkv)``; loops over the ``Hq / Hkv`` query heads of the group and the
  query rows reaching the block, accumulating ``dk``/``dv`` in registers.
* ``_bwd_dq``: grid ``(query tiles, B * Hq)``; the forward's loop again, accumulating ``dq``.

Two backward kernels rather than one with atomics: each output block is owned by exactly one program, so
there are no fp32 atomic adds (non-deterministic summation order, and a zero-filled fp32 buffer plus a cast
for every gradient) and GQA needs no reduction over query heads afterwards; the price is computing
``q . k`` and ``p`` twice, the standard trade-off of Triton's flash-attention backward.
``delta = rowsum(dout * out)`` is one torch op before them.

This module is a backend of :mod:`positional_lsh.ops.engine` (``triton_plan`` → ``triton_forward`` →
``triton_backward``); the entry point is ``plsh_attention(..., backend="triton")`` (or ``backend="auto"`` with
``method="multiplicity"`` on CUDA), which adds the op's non-finite-key rule and autograd.

``import triton`` is optional: without it this module still imports and :func:`check_triton_call` raises a clear
error. On CPU tensors the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton
is imported) — that is how the tests run; they have not been run or timed on a GPU here.
"""

from __future__ import annotations

import os

import torch

from positional_lsh.ops.multiplicity import sample_bounds
from positional_lsh.ops.partitions import Partitions

try:  # optional dependency: the package imports without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - tests/test_triton.py runs this in a subprocess
    triton = None
    tl = None

__all__ = [
    "check_triton_call",
    "triton_available",
    "triton_backward",
    "triton_forward",
    "triton_plan",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def triton_available() -> bool:
    """Whether Triton imported (it does not say whether a GPU or the interpreter can run the kernels)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands are cast to float32 first: bfloat16 under the interpreter (see ``_dot``)."""
    return dtype == torch.bfloat16 and _interpreting()


def block_sizes(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: query rows per program and keys per inner step (not tuned on a GPU)."""
    return (64, 64) if head_dim <= 64 else (64, 32)


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        # fp32 inputs: full fp32 products (the default on recent GPUs would be TF32, ~1e-3 relative error).
        # UPCAST: bfloat16 operands in Triton's CPU interpreter, whose tl.dot multiplies bf16 bit patterns
        # (triton-lang/triton#11584); bf16 x bf16 products are exact in fp32, so this is the GPU's arithmetic.
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _log_count(
        s,
        Starts,
        Ends,
        bound_base,
        offs_m,
        mask_m,
        pos_m,
        offs_n,
        Lq,
        Lk,
        T,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """``s + log c[i,j]`` over one (query tile, key block), ``-inf`` where ``c = 0``, above the causal
        diagonal, past ``Lk`` and on padding rows. ``c`` is counted from the ``T`` bounds of each row."""
        cnt = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for t in range(0, T):
            st = tl.load(Starts + bound_base + t * Lq + offs_m, mask=mask_m, other=Lk)
            inside = offs_n[None, :] >= st[:, None]
            if not CAUSAL:
                en = tl.load(Ends + bound_base + t * Lq + offs_m, mask=mask_m, other=0)
                inside = inside & (offs_n[None, :] < en[:, None])
            cnt += inside.to(tl.int32)
        keep = (cnt > 0) & (offs_n[None, :] < Lk) & mask_m[:, None]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= pos_m[:, None])
        bias = tl.log(tl.maximum(cnt, 1).to(tl.float32))
        return tl.where(keep, s + bias, float("-inf"))

    @triton.jit
    def _fwd(
        Q,
        K,
        V,
        Starts,
        Ends,
        RowLo,
        RowHi,
        Out,
        Lse,
        sqb,
        sqh,
        sqm,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sob,
        soh,
        som,
        Hq,
        GROUP,
        Lq,
        Lk,
        T,
        D,
        scale,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        hk = h // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < Lq
        mask_d = offs_d < D
        pos_m = offs_m + (Lk - Lq)
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        # Keys of the tile: both interval ends are nondecreasing in the row.
        lo = tl.min(tl.load(RowLo + h * Lq + offs_m, mask=mask_m, other=Lk), 0)
        hi = tl.max(tl.load(RowHi + h * Lq + offs_m, mask=mask_m, other=0), 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        bound_base = h * T * Lq
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_kv = (offs_n[:, None] < Lk) & mask_d[None, :]
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=mask_kv, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=mask_kv, other=0.0)
            s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale
            s = _log_count(
                s, Starts, Ends, bound_base, offs_m, mask_m, pos_m, offs_n, Lq, Lk, T, CAUSAL, BLOCK_M, BLOCK_N
            )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
            m_i = m_new
        # Every real row keeps its own key (c[i,i] = T), so l_i > 0 there; padding rows are not stored.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )
        tl.store(Lse + pid_bh * Lq + offs_m, m_i + tl.log(l_safe), mask=mask_m)

    @triton.jit
    def _bwd_dq(
        Q,
        K,
        V,
        DO,
        Starts,
        Ends,
        RowLo,
        RowHi,
        Lse,
        Delta,
        DQ,
        sqb,
        sqh,
        sqm,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sdb,
        sdh,
        sdm,
        Hq,
        GROUP,
        Lq,
        Lk,
        T,
        D,
        scale,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        hk = h // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < Lq
        mask_d = offs_d < D
        mask_q = mask_m[:, None] & mask_d[None, :]
        pos_m = offs_m + (Lk - Lq)
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=mask_q, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=mask_q, other=0.0)
        lse = tl.load(Lse + pid_bh * Lq + offs_m, mask=mask_m, other=0.0)
        delta = tl.load(Delta + pid_bh * Lq + offs_m, mask=mask_m, other=0.0)
        lo = tl.min(tl.load(RowLo + h * Lq + offs_m, mask=mask_m, other=Lk), 0)
        hi = tl.max(tl.load(RowHi + h * Lq + offs_m, mask=mask_m, other=0), 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        bound_base = h * T * Lq
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_kv = (offs_n[:, None] < Lk) & mask_d[None, :]
            k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=mask_kv, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=mask_kv, other=0.0)
            s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale
            s = _log_count(
                s, Starts, Ends, bound_base, offs_m, mask_m, pos_m, offs_n, Lq, Lk, T, CAUSAL, BLOCK_M, BLOCK_N
            )
            p = tl.exp(s - lse[:, None])
            dp = _dot(do, tl.trans(v), IEEE, UPCAST)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE, UPCAST)
        tl.store(
            DQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
            (dq * scale).to(DQ.dtype.element_ty),
            mask=mask_q,
        )

    @triton.jit
    def _bwd_dkdv(
        Q,
        K,
        V,
        DO,
        Starts,
        Ends,
        QFirst,
        QLast,
        Lse,
        Delta,
        DK,
        DV,
        sqb,
        sqh,
        sqm,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sdb,
        sdh,
        sdm,
        Hq,
        Hkv,
        GROUP,
        Lq,
        Lk,
        T,
        D,
        NUM_KB,
        scale,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_bhk = tl.program_id(1)
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask_kv = (offs_n[:, None] < Lk) & mask_d[None, :]
        k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=mask_kv, other=0.0)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=mask_kv, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * Hq + h
            # Query rows [first, last) reach this key block (precomputed by searchsorted on the row intervals).
            first = tl.load(QFirst + h * NUM_KB + pid_n)
            last = tl.load(QLast + h * NUM_KB + pid_n)
            first = (first // BLOCK_M) * BLOCK_M
            bound_base = h * T * Lq
            for start_m in range(first, last, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                mask_m = offs_m < Lq
                mask_q = mask_m[:, None] & mask_d[None, :]
                pos_m = offs_m + (Lk - Lq)
                q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=mask_q, other=0.0)
                do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=mask_q, other=0.0)
                lse = tl.load(Lse + bh * Lq + offs_m, mask=mask_m, other=0.0)
                delta = tl.load(Delta + bh * Lq + offs_m, mask=mask_m, other=0.0)
                s = _dot(q, tl.trans(k), IEEE, UPCAST) * scale
                s = _log_count(
                    s, Starts, Ends, bound_base, offs_m, mask_m, pos_m, offs_n, Lq, Lk, T, CAUSAL, BLOCK_M, BLOCK_N
                )
                p = tl.exp(s - lse[:, None])  # (BLOCK_M, BLOCK_N), 0 where excluded
                dv += _dot(tl.trans(p).to(do.dtype), do, IEEE, UPCAST)
                dp = _dot(do, tl.trans(v), IEEE, UPCAST)
                ds = p * (dp - delta[:, None])
                dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE, UPCAST)
        # dk/dv are allocated like k and v (contiguous): same strides.
        tl.store(
            DK + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=mask_kv,
        )
        tl.store(
            DV + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
            dv.to(DV.dtype.element_ty),
            mask=mask_kv,
        )


def triton_plan(
    partitions: Partitions, q_len: int, causal: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' plan: ``starts, ends (Hq, T, Lq)`` and ``row_lo, row_hi (Hq, Lq)``, int32 on ``device``.

    ``ends`` is ``starts`` (unused by the kernels) when causal; ``row_hi`` is ``i + 1`` then.
    """
    if partitions.num_samples >= 2**31 or partitions.seq_len >= 2**31:
        raise ValueError("partitions: num_samples and seq_len must fit in int32")
    n = partitions.seq_len
    pitch = partitions.pitch.to(device).t()[:, :, None]  # (H, T, 1) float64
    shift = partitions.shift.to(device).t()[:, :, None]
    pos = torch.arange(n - q_len, n, device=device, dtype=torch.long)
    start, end = sample_bounds(pitch, shift, n, pos[None, None, :].expand(pitch.shape[0], pitch.shape[1], -1))
    row_lo = start.amin(1)
    if causal:
        row_hi = (pos + 1).expand_as(row_lo)
        end = start
    else:
        row_hi = end.amax(1)
    as32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return as32(start), as32(end), as32(row_lo), as32(row_hi)


def check_triton_call(q: torch.Tensor) -> None:
    """Raise unless the Triton kernels can run on ``q (B, Hq, Lq, d)``: triton installed, a supported dtype and
    head dim, a CUDA device (or the interpreter on the CPU)."""
    if triton is None:
        raise ImportError(
            "the Triton path needs the optional dependency triton (pip install triton); "
            "without it use plsh_attention(..., method='multiplicity') with backend='auto' (the torch path)"
        )
    if q.dtype not in DTYPES:
        raise ValueError(
            f"q: the Triton kernels take float32, bfloat16 or float16, got {q.dtype} "
            "(float64: use plsh_attention(..., method='multiplicity') with backend='auto' or 'math')"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be <= {MAX_HEAD_DIM} for the Triton kernels, got {q.shape[-1]}")
    if q.device.type == "cpu" and not _interpreting():
        raise ValueError(
            "q: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported "
            "(the slow CPU interpreter, for tests); got tensors on cpu"
        )


def triton_forward(
    bounds: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of ``_fwd`` for contiguous ``q, k, v`` and the plan ``bounds`` of :func:`triton_plan`:
    ``out`` (``q``'s dtype) and ``lse (B, Hq, Lq)`` float32."""
    starts, ends, row_lo, row_hi = bounds
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    block_m, block_n = block_sizes(d)
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    _fwd[(triton.cdiv(lq, block_m), b * hq)](
        q, k, v, starts, ends, row_lo, row_hi, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hkv, lq, lk, starts.shape[1], d, scale,
        CAUSAL=causal, IEEE=q.dtype == torch.float32, UPCAST=_upcast(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip
    return out, lse


def triton_backward(
    bounds: tuple[torch.Tensor, ...],
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (the inputs' dtypes) from ``saved = (q, k, v, out, lse)`` (contiguous, as
    :func:`triton_forward` took and returned them) and the upstream gradient ``dout``."""
    q, k, v, out, lse = saved
    starts, ends, row_lo, row_hi = bounds
    dout = dout.contiguous()
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    t = starts.shape[1]
    block_m, block_n = block_sizes(d)
    block_d = max(16, triton.next_power_of_2(d))
    ieee = q.dtype == torch.float32
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, Hq, Lq)
    # Key block [k0, k0 + BLOCK_N) is reached by the rows with row_hi > k0 and row_lo < k0 + BLOCK_N.
    num_kb = triton.cdiv(lk, block_n)
    k0 = torch.arange(0, num_kb * block_n, block_n, device=q.device, dtype=torch.int32)
    k0 = k0.expand(hq, -1).contiguous()
    q_first = torch.searchsorted(row_hi, k0, right=True).to(torch.int32).contiguous()
    q_last = torch.searchsorted(row_lo, k0 + block_n).to(torch.int32).contiguous()
    # All contiguous: the kernels index dq with q's strides, dk with k's and dv with v's.
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _bwd_dq[(triton.cdiv(lq, block_m), b * hq)](
        q, k, v, dout, starts, ends, row_lo, row_hi, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        hq, hq // hkv, lq, lk, t, d, scale,
        CAUSAL=causal, IEEE=ieee, UPCAST=_upcast(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip
    _bwd_dkdv[(num_kb, b * hkv)](
        q, k, v, dout, starts, ends, q_first, q_last, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        hq, hkv, hq // hkv, lq, lk, t, d, num_kb, scale,
        CAUSAL=causal, IEEE=ieee, UPCAST=_upcast(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )  # fmt: skip
    return dq, dk, dv
