"""The Triton kernels of the multiplicity form: ``fwd_kernel`` (one launch), ``bwd_dq_kernel`` and ``bwd_dkdv_kernel``.

Flash-attention structure with fp32 accumulation. The count ``c[i,j]`` of a (query tile, key block) comes from the
plan of :mod:`positional_lsh.ops._engine.triton.plan` through :func:`block_count`, whose cost does not grow with ``T``:
a load from the near table next to the diagonal, and far from it a count over the tile's few *events* (the
integer operations per score entry are those of ``scripts/triton_work.py``). Scores use base 2:
``s2 = q.k * scale * log2(e)``; a kept entry's weight is ``c * 2^(s2 - m)`` (``log c`` is never taken; ``lse`` is
returned in natural log). Offsets into ``q, k, v``, the outputs, ``lse``/``delta`` and the plan are 64-bit.

* ``fwd_kernel``: grid ``(query tiles, B * Hq)``; online softmax over the key blocks ``[tile_first, tile_last)``.
* ``bwd_dq_kernel``: the same grid and loop, accumulating ``dq``. With the constexpr ``DIST_GRAD`` (the slope
  gradient; off: the plain kernel, ``Dist`` a constexpr ``None``) it also sums ``dS_ij |i - j|`` over its tile's
  rows and keys and writes that partial to ``Dist[b * Hq + h, tile]`` (no atomics: the host sums the partials).
* ``bwd_dkdv_kernel``: grid ``(key blocks, B * Hkv)``; loops over the ``Hq / Hkv`` query heads of the group and the
  query tiles ``[kb_first, kb_last)`` that visit the block. Each output block has one owner: no atomics.

The forward and ``dq`` kernels share their tile (``_query_tile``, ``_tile_events``) and their loop body
(``_key_block``: a key block's loads, counts and scores); all three share the scores (``_scores``) and weights
(``_weights``), the backward kernels ``_row_stats`` and ``_dscores``. Triton inlines these helpers: the compile checks
(registers, spills) are those of the kernels.

``import triton`` is optional: without it this module defines nothing but ``triton = None``.
"""

from __future__ import annotations

try:  # optional dependency: the package imports without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - tests/ops/engine/test_triton.py runs this in a subprocess
    triton = None
    tl = None

__all__ = ["KERNEL_NAMES", "LN2", "LOG2E", "block_count", "bwd_dkdv_kernel", "bwd_dq_kernel", "fwd_kernel", "triton"]

KERNEL_NAMES = ("fwd_kernel", "bwd_dq_kernel", "bwd_dkdv_kernel")
"""The kernels of this module (the compile checks of ``scripts/triton_compile.py`` cover each)."""
LOG2E = 1.4426950408889634
"""``log2(e)``: the kernels work in base 2 (the host passes ``scale * LOG2E``; the backward takes ``lse`` to base 2)."""
LN2 = 0.6931471805599453
"""``ln(2)``: the forward returns its base-2 ``lse`` in natural log."""

if triton is not None:
    _LOG2E = tl.constexpr(LOG2E)  # the kernels' copies (a jit function reads only constexpr globals)
    _LN2 = tl.constexpr(LN2)

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
    def _far(U, V, ns, rows, cols, s_lo, s_hi, b_lo, b_hi, ROWS: tl.constexpr, COLS: tl.constexpr):
        """``#{t : u_t <= col, v_t > row}`` over keys ``cols`` of one far block. Events ``[0, ns)`` are stable (a step
        in the column only), ``[ns, T)`` breaking, each part sorted by ``u``; ``[s_lo, s_hi)`` are the stable ones
        inside the block, ``[ns, b_lo)`` the breaking ones before it (a step in the row only) and ``[b_lo, b_hi)``
        those inside it (one select per entry each)."""
        colcnt = tl.zeros([COLS], dtype=tl.int32) + s_lo
        for r in range(s_lo, s_hi):
            colcnt += (cols >= tl.load(U + r)).to(tl.int32)
        run = tl.zeros([ROWS], dtype=tl.int32)
        for r in range(ns, b_lo):
            run += (tl.load(V + r) > rows).to(tl.int32)
        cnt = tl.broadcast_to(run[:, None], (ROWS, COLS))
        for r in range(b_lo, b_hi):  # columns from u on see the events so far: overwrite with the running count
            run += (tl.load(V + r) > rows).to(tl.int32)
            cnt = tl.where((cols >= tl.load(U + r))[None, :], run[:, None], cnt)
        return cnt + colcnt[None, :]

    @triton.jit
    def _near(row_ptrs, o0, mask_m, COLS: tl.constexpr):
        """Counts of a near block: columns ``o0 + [0, COLS)`` of the rows' near-table rows."""
        c = tl.load(row_ptrs[:, None] + (o0 + tl.arange(0, COLS))[None, :], mask=mask_m[:, None], other=0)
        return c.to(tl.int32)

    @triton.jit
    def block_count(
        kb,
        tb0,
        o0,
        offs_n,
        pos,
        mask_m,
        near_ptrs,
        LU,
        LV,
        lns,
        LC,
        RU,
        RV,
        rns,
        RC,
        CAUSAL: tl.constexpr,
        TILE_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NEAR: tl.constexpr,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
    ):
        """``(c, c > 0)`` over ``ROWS`` rows of one query tile (key positions ``pos``) and ``COLS`` keys ``offs_n`` of
        key block ``kb``; ``tb0`` is the key block of the tile's first row, ``o0`` the near-table column of
        ``offs_n[0]`` (``offs_n[0] - i0 + NEAR``). ``LU, LV``
        (``RU, RV``) are the tile's left (right) events, ``lns`` (``rns``) how many are stable, ``LC`` (``RC``) its
        event counts below each key-block boundary, pairs ``(stable, breaking)`` indexed by the key block."""
        near_lo = tb0 - NEAR // BLOCK_N
        if kb < near_lo:
            c = LC + 2 * kb
            cnt = _far(LU, LV, lns, pos, offs_n, tl.load(c), tl.load(c + 2), tl.load(c + 1), tl.load(c + 3), ROWS, COLS)
        else:
            if CAUSAL:
                cnt = _near(near_ptrs, o0, mask_m, COLS)
            else:
                if kb < tb0 + (TILE_M + NEAR) // BLOCK_N:
                    cnt = _near(near_ptrs, o0, mask_m, COLS)
                else:  # negated coordinates: the block's low end is boundary kb + 1
                    c = RC + 2 * kb
                    cnt = _far(
                        RU, RV, rns, -pos, -offs_n, tl.load(c + 2), tl.load(c), tl.load(c + 3), tl.load(c + 1),
                        ROWS, COLS,
                    )  # fmt: skip
        return cnt, cnt > 0

    @triton.jit
    def _scores(q, k, keep, scale2, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """Base-2 scores ``q.k * scale2`` of one block, ``-inf`` where its count is 0 (not ``keep``)."""
        return tl.where(keep, _dot(q, tl.trans(k), IEEE, UPCAST) * scale2, float("-inf"))

    @triton.jit
    def _tile_events(tile, T, LU, LV, LNS, LC, RU, RV, RNS, RC, CutBase):
        """The plan's state of query tile ``tile`` (``h * num_tiles + m``) as :func:`block_count` takes it:
        ``(LU, LV, lns, LC, RU, RV, rns, RC)`` moved to the tile's events and key-block boundary counts."""
        ev = tile * T
        lns = tl.load(LNS + tile)
        rns = tl.load(RNS + tile)
        cut = 2 * tl.load(CutBase + tile)  # LC + cut + 2 * kb: the counts at key-block boundary kb
        return LU + ev, LV + ev, lns, LC + cut, RU + ev, RV + ev, rns, RC + cut

    @triton.jit
    def _query_tile(Hq, GROUP, Lq, Lk, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """The query tile of a program of the grid ``(query tiles, B * Hq)``: ``(pid_m, pid_bh, b, h, hk, offs_m,
        offs_d, mask_m, mask_d, i0, pos)``, ``pos = i0 + [0, BLOCK_M)`` the rows' key positions (the queries are the
        last ``Lq`` of the ``Lk`` positions)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // Hq
        h = pid_bh % Hq
        hk = h // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < Lq
        mask_d = offs_d < HEAD_DIM
        i0 = (Lk - Lq) + pid_m * BLOCK_M
        return pid_m, pid_bh, b, h, hk, offs_m, offs_d, mask_m, mask_d, i0, i0 + tl.arange(0, BLOCK_M)

    @triton.jit
    def _key_block(
        q,
        kb,
        k_base,
        skn,
        v_base,
        svn,
        offs_d,
        mask_d,
        Lk,
        grid0,
        i0,
        tb0,
        pos,
        mask_m,
        near_ptrs,
        events,
        scale2,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        NEAR: tl.constexpr,
    ):
        """The loop body of ``fwd_kernel`` and ``bwd_dq_kernel``: key block ``kb`` against the ``BLOCK_M`` rows of a
        query tile (from :func:`_query_tile`; ``events`` from :func:`_tile_events`): ``(k, v, s, cnt)``, the block's
        keys and values, base-2 scores (``-inf`` where excluded) and counts."""
        k0 = grid0 + kb * BLOCK_N
        offs_n = k0 + tl.arange(0, BLOCK_N)
        mask_kv = ((offs_n >= 0) & (offs_n < Lk))[:, None] & mask_d[None, :]
        rows_n = offs_n.to(tl.int64)[:, None]
        k = tl.load(k_base + rows_n * skn + offs_d[None, :], mask=mask_kv, other=0.0)
        v = tl.load(v_base + rows_n * svn + offs_d[None, :], mask=mask_kv, other=0.0)
        lu, lv, lns, lc, ru, rv, rns, rc = events
        cnt, keep = block_count(
            kb, tb0, k0 - i0 + NEAR, offs_n, pos, mask_m, near_ptrs, lu, lv, lns, lc, ru, rv, rns, rc, CAUSAL,
            BLOCK_M, BLOCK_N, NEAR, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        return k, v, _scores(q, k, keep, scale2, IEEE, UPCAST), cnt

    @triton.jit
    def _row_stats(Lse, Delta, bh, Lq, offs_m, mask_m):
        """``(lse2, delta)`` of rows ``offs_m`` of query head ``bh = b * Hq + h``: the forward's ``lse`` in base 2 and
        ``delta = rowsum(dO * O)``."""
        row_stat = bh.to(tl.int64) * Lq + offs_m
        lse2 = tl.load(Lse + row_stat, mask=mask_m, other=0.0) * _LOG2E
        return lse2, tl.load(Delta + row_stat, mask=mask_m, other=0.0)

    @triton.jit
    def _weights(s, cnt, m):
        """The weights ``c 2^(s - m)`` of one block's base-2 scores against a per-row ``m`` (the running maximum in the
        forward, ``lse`` in base 2 in the backward): 0 where excluded."""
        return tl.exp2(s - m[:, None]) * cnt.to(tl.float32)

    @triton.jit
    def _dscores(p, do, v, delta, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """The score gradient ``dS = p (dO.v - delta)`` of one block (without ``scale``)."""
        return p * (_dot(do, tl.trans(v), IEEE, UPCAST) - delta[:, None])

    @triton.jit
    def fwd_kernel(
        Q,
        K,
        V,
        Out,
        Lse,
        Near,
        LU,
        LV,
        LNS,
        LC,
        RU,
        RV,
        RNS,
        RC,
        CutBase,
        TileFirst,
        TileLast,
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
        num_tiles,
        grid0,
        width,
        scale2,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NEAR: tl.constexpr,
    ):
        pid_m, pid_bh, b, h, hk, offs_m, offs_d, mask_m, mask_d, i0, pos = _query_tile(
            Hq, GROUP, Lq, Lk, HEAD_DIM, BLOCK_M, BLOCK_D
        )
        mask_q = mask_m[:, None] & mask_d[None, :]
        rows_m = offs_m.to(tl.int64)[:, None]
        q = tl.load(
            Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows_m * sqm + offs_d[None, :], mask=mask_q, other=0.0
        )
        tile = h.to(tl.int64) * num_tiles + pid_m
        events = _tile_events(tile, T, LU, LV, LNS, LC, RU, RV, RNS, RC, CutBase)
        tb0 = (i0 - grid0) // BLOCK_N
        near_ptrs = Near + (h.to(tl.int64) * Lq + offs_m) * width
        k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for kb in range(tl.load(TileFirst + tile), tl.load(TileLast + tile)):
            _, v, s, cnt = _key_block(
                q, kb, k_base, skn, v_base, svn, offs_d, mask_d, Lk, grid0, i0, tb0, pos, mask_m, near_ptrs, events,
                scale2, CAUSAL, IEEE, UPCAST, BLOCK_M, BLOCK_N, NEAR,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = _weights(s, cnt, m_safe)
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
            m_i = m_new
        # Every real row keeps its own key (c[i,i] = T), so l_i > 0 there; padding rows are not stored.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(
            Out + b.to(tl.int64) * sob + h.to(tl.int64) * soh + rows_m * som + offs_d[None, :],
            (acc / l_safe[:, None]).to(Out.dtype.element_ty),
            mask=mask_q,
        )
        tl.store(Lse + pid_bh.to(tl.int64) * Lq + offs_m, (m_i + tl.log2(l_safe)) * _LN2, mask=mask_m)

    @triton.jit
    def bwd_dq_kernel(
        Q,
        K,
        V,
        DO,
        Lse,
        Delta,
        DQ,
        Dist,
        Near,
        LU,
        LV,
        LNS,
        LC,
        RU,
        RV,
        RNS,
        RC,
        CutBase,
        TileFirst,
        TileLast,
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
        num_tiles,
        grid0,
        width,
        scale,
        scale2,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NEAR: tl.constexpr,
        DIST_GRAD: tl.constexpr,
    ):
        pid_m, pid_bh, b, h, hk, offs_m, offs_d, mask_m, mask_d, i0, pos = _query_tile(
            Hq, GROUP, Lq, Lk, HEAD_DIM, BLOCK_M, BLOCK_D
        )
        mask_q = mask_m[:, None] & mask_d[None, :]
        rows_m = offs_m.to(tl.int64)[:, None]
        q = tl.load(
            Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows_m * sqm + offs_d[None, :], mask=mask_q, other=0.0
        )
        do = tl.load(
            DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + rows_m * sdm + offs_d[None, :], mask=mask_q, other=0.0
        )
        lse2, delta = _row_stats(Lse, Delta, pid_bh, Lq, offs_m, mask_m)
        tile = h.to(tl.int64) * num_tiles + pid_m
        events = _tile_events(tile, T, LU, LV, LNS, LC, RU, RV, RNS, RC, CutBase)
        tb0 = (i0 - grid0) // BLOCK_N
        near_ptrs = Near + (h.to(tl.int64) * Lq + offs_m) * width
        k_base = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_base = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if DIST_GRAD:  # sum_j dS_ij |i - j| per row, in tile-relative float coordinates (exact below 2^24)
            dist = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kb in range(tl.load(TileFirst + tile), tl.load(TileLast + tile)):
            k, v, s, cnt = _key_block(
                q, kb, k_base, skn, v_base, svn, offs_d, mask_d, Lk, grid0, i0, tb0, pos, mask_m, near_ptrs, events,
                scale2, CAUSAL, IEEE, UPCAST, BLOCK_M, BLOCK_N, NEAR,
            )  # fmt: skip
            ds = _dscores(_weights(s, cnt, lse2), do, v, delta, IEEE, UPCAST)
            dq += _dot(ds.to(k.dtype), k, IEEE, UPCAST)
            if DIST_GRAD:  # ds is 0 where p is (c = 0, keys outside [0, Lk)) and on padding rows (do = delta = 0)
                col = (grid0 + kb * BLOCK_N - i0 + tl.arange(0, BLOCK_N)).to(tl.float32)  # key minus the first row
                dist += tl.sum(ds * tl.abs(tl.arange(0, BLOCK_M).to(tl.float32)[:, None] - col[None, :]), 1)
        tl.store(
            DQ + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rows_m * sqm + offs_d[None, :],
            (dq * scale).to(DQ.dtype.element_ty),
            mask=mask_q,
        )
        if DIST_GRAD:  # one partial per program, summed on the host: deterministic, no atomics
            tl.store(Dist + pid_bh.to(tl.int64) * num_tiles + pid_m, tl.sum(tl.where(mask_m, dist, 0.0), 0))

    @triton.jit
    def bwd_dkdv_kernel(
        Q,
        K,
        V,
        DO,
        Lse,
        Delta,
        DK,
        DV,
        Near,
        LU,
        LV,
        LNS,
        LC,
        RU,
        RV,
        RNS,
        RC,
        CutBase,
        KbFirst,
        KbLast,
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
        num_tiles,
        num_kb,
        grid0,
        width,
        scale,
        scale2,
        CAUSAL: tl.constexpr,
        IEEE: tl.constexpr,
        UPCAST: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NEAR: tl.constexpr,
        SUB_M: tl.constexpr,
        SUB_N: tl.constexpr,
    ):
        # A program owns SUB_N keys of key block kb and visits its query tiles SUB_M rows at a time.
        kb = tl.program_id(0) // (BLOCK_N // SUB_N)
        pid_bhk = tl.program_id(1)
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        k_sub = grid0 + tl.program_id(0) * SUB_N
        offs_n = k_sub + tl.arange(0, SUB_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        mask_kv = ((offs_n >= 0) & (offs_n < Lk))[:, None] & mask_d[None, :]
        rows_n = offs_n.to(tl.int64)[:, None]
        k_ptrs = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + rows_n * skn + offs_d[None, :]
        v_ptrs = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + rows_n * svn + offs_d[None, :]
        k = tl.load(k_ptrs, mask=mask_kv, other=0.0)
        v = tl.load(v_ptrs, mask=mask_kv, other=0.0)
        dk = tl.zeros([SUB_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([SUB_N, BLOCK_D], dtype=tl.float32)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            bh = b * Hq + h
            q_base = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_base = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
            kb_row = h.to(tl.int64) * num_kb + kb
            for m in range(tl.load(KbFirst + kb_row), tl.load(KbLast + kb_row)):
                i0 = (Lk - Lq) + m * BLOCK_M
                tb0 = (i0 - grid0) // BLOCK_N
                tile = h.to(tl.int64) * num_tiles + m
                for mm in range(0, tl.minimum(BLOCK_M, Lq - m * BLOCK_M), SUB_M):
                    offs_m = m * BLOCK_M + mm + tl.arange(0, SUB_M)
                    mask_m = offs_m < Lq
                    mask_q = mask_m[:, None] & mask_d[None, :]
                    rows_m = offs_m.to(tl.int64)[:, None]
                    q = tl.load(q_base + rows_m * sqm + offs_d[None, :], mask=mask_q, other=0.0)
                    do = tl.load(do_base + rows_m * sdm + offs_d[None, :], mask=mask_q, other=0.0)
                    lse2, delta = _row_stats(Lse, Delta, bh, Lq, offs_m, mask_m)
                    lu, lv, lns, lc, ru, rv, rns, rc = _tile_events(tile, T, LU, LV, LNS, LC, RU, RV, RNS, RC, CutBase)
                    cnt, keep = block_count(
                        kb, tb0, k_sub - i0 + NEAR, offs_n, i0 + mm + tl.arange(0, SUB_M), mask_m,
                        Near + (h.to(tl.int64) * Lq + offs_m) * width, lu, lv, lns, lc, ru, rv, rns, rc,
                        CAUSAL, BLOCK_M, BLOCK_N, NEAR, SUB_M, SUB_N,
                    )  # fmt: skip
                    p = _weights(_scores(q, k, keep, scale2, IEEE, UPCAST), cnt, lse2)  # (SUB_M, SUB_N)
                    dv += _dot(tl.trans(p).to(do.dtype), do, IEEE, UPCAST)
                    ds = _dscores(p, do, v, delta, IEEE, UPCAST)
                    dk += _dot(tl.trans(ds).to(q.dtype), q, IEEE, UPCAST)
        # dk/dv are allocated like k and v (contiguous): same strides.
        tl.store(
            DK + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + rows_n * skn + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=mask_kv,
        )
        tl.store(
            DV + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + rows_n * svn + offs_d[None, :],
            dv.to(DV.dtype.element_ty),
            mask=mask_kv,
        )
