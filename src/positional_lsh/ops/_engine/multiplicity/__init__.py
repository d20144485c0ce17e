"""The multiplicity form of the estimator: one masked attention call per group of query tiles.

For head ``h`` with ``T`` sampled partitions, let ``c[i,j] = #{t : i and j share a block of sample t}``. Then
``Mbar = c / T`` and the estimator (docs/design.md) is

    out_i = softmax_j(s[i,j] + log c[i,j]) v_j          (the 1/T cancels; log 0 = -inf)

with ``s[i,j] = scale * q_i . k_j`` and, when causal, ``-inf`` for ``j > i``. Every sampled block is a
contiguous run of positions, so with ``start_t(i)``/``end_t(i)`` the first/one-past-last position of ``i``'s
block in sample ``t``:

* causal: ``c[i,j] = #{t : start_t(i) <= j}`` for ``j <= i`` — a step function of ``j`` with at most ``T`` steps;
* bidirectional: ``c[i,j] = #{t : start_t(i) <= j < end_t(i)}``.

Query ``i``'s keys are the interval ``[min_t start_t(i), max_t end_t(i))``: its work is the *union* of its
``T`` blocks (mean extent about ``sigma * H_T`` causal, ``H_T`` the harmonic number) instead of their sum
(``T * sigma``), which is where the per-sample path spends its time at large ``T``.

Computation. Queries are cut into tiles of ``tile`` consecutive rows (per head, chosen by the plan). A tile's
keys are one window ``[k_start, k_start + k_len)`` covering the union of its rows' intervals (both ends are
monotone in ``i``, so the first and last row fix it). Tiles with equal ``(tile, k_len)`` (``k_len`` rounded
up to a few sizes per octave) form a *group*: one batched attention call over ``(B, tiles, tile, k_len)``
with the additive float mask ``log c`` (``-inf`` outside), built on the device from int32 counts: a scatter of
the block starts (and ends) of every row in each head's distinct partitions, weighted by how many samples drew
each (or, causal with integer pitches, the blocks' moves summed down the rows: :func:`_move_events`), an integer
cumulative sum over keys — ``O(U + k_len)`` per row, ``U <= T`` — and a lookup of ``log c`` in the table of its
``T + 1`` values (``mask.log_count_table``). Groups are split into calls of about ``plan.CHUNK_ELEMENTS`` mask
entries, whose index tensors are planned once (``mask.kernel_calls``).
Each query row lives in exactly one tile, so the call's ``(out, lse)`` are final: no merge. The backward
is the same attention's backward with the saved ``out``/``lse`` and the mask rebuilt, its key gradients
scatter-added back (tiles share keys). The surrogate slope gradient (``dist_grad``) adds each masked call's
``sum_ij dS_ij |i - j|`` over its rows and union keys (``ops._engine.torch_attention.attend_bias_grad``, one more
math pass over the call's scores) into its tiles' query heads.

All of it is device-agnostic torch: gathers, ``scatter_add_``, ``cumsum``, ``index_select`` and the attention kernels
of :mod:`positional_lsh.ops._engine.torch_attention` (CPU: torch's fused flash op with ``attn_mask``; elsewhere: chunked
matmul). The number of kernel calls is the number of groups (a handful per head), split further only to cap
the memory of one call (``plan.CHUNK_ELEMENTS``). Each head's tile height is the cheapest by the cost model
(:mod:`positional_lsh.ops._engine.cost`).

Three modules, in the order a call uses them: :mod:`~positional_lsh.ops._engine.multiplicity.plan` (the tiles and
their groups, host-side, from the partitions), :mod:`~positional_lsh.ops._engine.multiplicity.mask` (the kernel
calls of a plan and the mask ``log c`` of each) and :mod:`~positional_lsh.ops._engine.multiplicity.backend` (the
backend: ``MultiplicityBackend``, the rows ``("multiplicity", "flash")`` and ``("multiplicity", "math")`` of the
engine's table, implementing :class:`~positional_lsh.ops._engine.backend.Backend` with a ``MultiplicityPlan``).
"""
