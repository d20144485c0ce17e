"""positional_lsh.ops.kvcache with ``key_positions``: attention over a static cache's buffer of slots (empty, padded,
dropped), against float64 oracles written from the definitions (Mbar from naive loops over the blocks, ALiBi by an
explicit bias), against the full ops on the whole sequence, and compiled: one graph for every decoding step."""

from __future__ import annotations

import math

import pytest
import torch

from positional_lsh import alibi_attention, plsh_attention, sample_partitions
from positional_lsh.ops.kvcache import plsh_attention_with_kvcache, slot_attention_weights

from conftest import naive_mean_mask

SLOPES = torch.tensor([0.5, 0.12, 0.03, 0.0])  # the last head has no bias: one block, pitch inf


def _naive(q, k, v, pos, bias_of, causal=True):
    """float64 loops: query ``r`` (slot ``Lk - Lq + r``) over the slots with ``0 <= pos[j]`` (``<= pos[i]`` when
    causal), weights ``exp(s + bias_of(h, pos_i, pos_j))``; a masked query row (or one without a key) is zeros."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=torch.float64)
    for row in range(b):
        for h in range(hq):
            hk = h // (hq // hkv)
            for r in range(lq):
                i = int(pos[row, lk - lq + r])
                if i < 0:
                    continue
                logits, values = [], []
                for j in range(lk):
                    pj = int(pos[row, j])
                    if pj < 0 or (causal and pj > i):
                        continue
                    bias = bias_of(h, i, pj)
                    if bias == -math.inf:
                        continue
                    logits.append(float(q[row, h, r] @ k[row, hk, j]) / math.sqrt(d) + bias)
                    values.append(v[row, hk, j])
                if logits:
                    w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    out[row, h, r] = (w[:, None] * torch.stack(values)).sum(0)
    return out


def _buffer(n: int, cap: int, b: int = 2, hkv: int = 2, d: int = 8, seed: int = 0):
    """A sequence of ``n`` tokens per row (row 1 left-padded by 3, with a hole at 6) in a right-aligned buffer of
    ``cap`` slots: ``(k, v, pos, k_all, v_all, valid)``; empty slots and padded tokens hold NaN."""
    g = torch.Generator().manual_seed(seed)
    k_all = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v_all = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :3] = False
    valid[1, 6] = False
    first = valid.to(torch.int8).argmax(-1, keepdim=True)
    abs_pos = torch.arange(n - cap, n)
    pos = torch.where((abs_pos >= 0) & valid.gather(1, abs_pos.clamp_min(0).expand(b, cap)), abs_pos - first, -1)
    nan = torch.full((b, hkv, cap, d), float("nan"), dtype=torch.float64)
    held = slice(max(0, n - cap), n)
    k = nan.clone()
    v = nan.clone()
    k[:, :, cap - (held.stop - held.start) :] = k_all[:, :, held]
    v[:, :, cap - (held.stop - held.start) :] = v_all[:, :, held]
    masked = ~(pos >= 0)[:, None, :, None]
    return k.masked_fill(masked, float("nan")), v.masked_fill(masked, float("nan")), pos, k_all, v_all, valid


def _q(lq: int, b: int = 2, hq: int = 4, d: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, hq, lq, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize(("n", "cap", "lq"), [(20, 28, 1), (20, 28, 3), (60, 24, 1), (60, 24, 2)])
def test_plsh_slots_equal_the_dense_oracle(n, cap, lq):
    """Empty slots (``cap > n``), dropped keys (``cap < n``), left padding and a hole, grouped heads."""
    parts = sample_partitions(n, SLOPES, 5, generator=3)
    mbar = naive_mean_mask(parts.pitch, parts.shift, n)
    k, v, pos, _, _, _ = _buffer(n, cap)
    q = _q(lq)

    def bias_of(h: int, i: int, j: int) -> float:
        return math.log(mbar[h, i, j]) if mbar[h, i, j] > 0 else -math.inf

    out = plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos)
    torch.testing.assert_close(out, _naive(q, k, v, pos, bias_of), rtol=0, atol=1e-12)
    w = slot_attention_weights(q, k, pos, parts)
    assert torch.isfinite(w).all() and (w[..., pos[:, None, None, :].expand_as(w) < 0] == 0).all()
    torch.testing.assert_close(torch.nan_to_num(w).sum(-1), torch.ones_like(w.sum(-1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [None, 3.0])
def test_alibi_slots_equal_the_dense_oracle(window):
    n, cap, lq = 30, 12, 2
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.0], dtype=torch.float64)
    k, v, pos, _, _, _ = _buffer(n, cap)
    q = _q(lq)

    def bias_of(h: int, i: int, j: int) -> float:
        return -math.inf if window is not None and abs(i - j) > window else -float(slopes[h]) * abs(i - j)

    out = plsh_attention_with_kvcache(q, k, v, slopes=slopes, window=window, key_positions=pos)
    torch.testing.assert_close(out, _naive(q, k, v, pos, bias_of), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["plsh", "alibi", "window"])
def test_slots_equal_the_full_op_on_the_whole_sequence(mode):
    """The slots' positions are counted as the ops' key_padding_mask counts them: the last queries of a left-padded
    sequence with a hole give the full op's rows, keys dropped beyond the reach included (positional LSH: the
    buffer holds the reach)."""
    n, lq = 80, 2
    parts = sample_partitions(n, torch.tensor([0.5, 0.3, 0.2, 0.25]), 4, generator=5)
    reach = int(torch.ceil(parts.pitch).max()) - 1 if mode == "plsh" else 6
    k, v, pos, k_all, v_all, valid = _buffer(n, reach + lq + 1)
    assert (pos[:, 0] >= 0).all() and reach + lq + 1 < n  # keys were dropped
    q = _q(lq)
    q_all = torch.cat([_q(n - lq, seed=7), q], 2)
    if mode == "plsh":
        full = plsh_attention(q_all, k_all, v_all, partitions=parts, key_padding_mask=valid)
        out = plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos)
    else:
        window = None if mode == "alibi" else 6.0
        full = alibi_attention(q_all, k_all, v_all, 0.3, window=window, key_padding_mask=valid)
        if window is None:  # exact ALiBi keeps every key: a buffer of the whole sequence
            k, v, pos, _, _, _ = _buffer(n, n + 3)
        out = plsh_attention_with_kvcache(q, k, v, slopes=0.3, window=window, key_positions=pos)
    torch.testing.assert_close(out, full[:, :, -lq:], rtol=0, atol=1e-12)


def test_masked_query_rows_are_zeros_and_half_types_round():
    n, cap = 12, 16
    parts = sample_partitions(n, SLOPES, 4, generator=2)
    k, v, pos, _, _, _ = _buffer(n, cap)
    pos[1, -1] = -1  # the query's own slot is masked: a padded query row
    q = _q(1)
    out = plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos)
    assert torch.isfinite(out[0]).all() and (out[1] == 0).all()
    ref = out.float()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        kk, vv = torch.nan_to_num(k).to(dtype), torch.nan_to_num(v).to(dtype)
        low = plsh_attention_with_kvcache(q.to(dtype), kk, vv, parts, key_positions=pos.int())
        assert low.dtype == dtype
        torch.testing.assert_close(low.float(), ref, rtol=0, atol=tol)


def test_one_compiled_graph_serves_every_step():
    """The decoding step of a static cache: the same shapes at every step, the positions data. After the first call
    no recompilation (``fail_on_recompile``), and each step equals eager."""
    torch._dynamo.reset()
    parts = sample_partitions(64, SLOPES, 4, generator=4)

    def step(q, k, v, pos):
        return plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos), plsh_attention_with_kvcache(
            q, k, v, slopes=SLOPES, window=4.0, key_positions=pos
        )

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
    for i, n in enumerate((8, 9, 30, 47)):
        k, v, pos, _, _, _ = _buffer(n, 24)
        q = _q(1, seed=n)
        with torch.compiler.set_stance("fail_on_recompile") if i else torch.compiler.set_stance("default"):
            got = compiled(q, k, v, pos)
        for a, b in zip(got, step(q, k, v, pos), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    torch._dynamo.reset()


def test_bad_key_positions_are_refused_naming_the_argument():
    parts = sample_partitions(8, SLOPES, 2, generator=0)
    k, v, pos, _, _, _ = _buffer(8, 10)
    q = _q(1)
    for bad in (pos[:1], pos.float(), pos[:, :-1], [0, 1]):
        with pytest.raises(ValueError, match="key_positions must be a \\(2, 10\\) int32 or int64"):
            plsh_attention_with_kvcache(q, k, v, parts, key_positions=bad)
    with pytest.raises(ValueError, match="key_offset=0 and no key_padding_mask"):
        plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos, key_offset=3)
    with pytest.raises(ValueError, match="key_offset=0 and no key_padding_mask"):
        plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos, key_padding_mask=pos >= 0)
    with pytest.raises(ValueError, match="method='samples' cannot run with key_positions"):
        plsh_attention_with_kvcache(q, k, v, parts, key_positions=pos, method="samples")
    with pytest.raises(ValueError, match="backend='flash' cannot run with key_positions"):
        plsh_attention_with_kvcache(q, k, v, slopes=0.1, key_positions=pos, backend="flash")
    with pytest.raises(ValueError, match="partitions are for 4 heads; q has 2 heads"):
        plsh_attention_with_kvcache(q[:, :2], k, v, parts, key_positions=pos)
    with pytest.raises(ValueError, match="exactly one"):
        slot_attention_weights(q, k, pos)
    for bad in (torch.zeros(2, 4, 1, 9), torch.zeros(2, 1, 10), pos[:, None, None] >= 0):
        with pytest.raises(ValueError, match=r"attn_mask must be a float tensor broadcastable to \(2, 4, 1, 10\)"):
            slot_attention_weights(q, k, pos, parts, attn_mask=bad)


def test_labels_at_equals_the_labels_and_continues_the_blocks():
    parts = sample_partitions(50, SLOPES, 6, scheme="gamma", generator=9)
    assert torch.equal(parts.labels_at(torch.arange(50)), parts.labels())
    longer = parts.with_seq_len(400).labels()
    pos = torch.tensor([[0, 49, 50, 399], [7, 123, 200, 300]])
    assert torch.equal(parts.labels_at(pos), longer[:, :, pos])


@pytest.mark.parametrize("mode", ["plsh", "window"])
def test_slot_gradients_pass_gradcheck_and_equal_the_full_op(mode):
    """The slots' output is differentiable in ``q, k, v`` (float64 gradcheck with empty, masked and dropped slots),
    and its gradients equal the full op's on the whole sequence (the rows the buffer serves)."""
    n, lq = 40, 2
    parts = sample_partitions(n, torch.tensor([0.5, 0.3, 0.2, 0.25]), 3, generator=5)
    reach = int(torch.ceil(parts.pitch).max()) - 1 if mode == "plsh" else 6
    k, v, pos, k_all, v_all, valid = _buffer(n, reach + lq + 1)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)
    q = _q(lq).requires_grad_()
    bias = {"partitions": parts} if mode == "plsh" else {"slopes": 0.3, "window": 6.0}

    def f(q, k, v):
        return plsh_attention_with_kvcache(q, k, v, key_positions=pos, **bias)

    assert torch.autograd.gradcheck(f, (q, k.requires_grad_(), v.requires_grad_()))
    q_all = torch.cat([_q(n - lq, seed=7), q.detach()], 2).requires_grad_()
    k_all.requires_grad_()
    v_all.requires_grad_()
    if mode == "plsh":
        full = plsh_attention(q_all, k_all, v_all, partitions=parts, key_padding_mask=valid)
    else:
        full = alibi_attention(q_all, k_all, v_all, 0.3, window=6.0, key_padding_mask=valid)
    dout = torch.randn(full[:, :, -lq:].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (full[:, :, -lq:] * dout).sum().backward()
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    (f(q2, k2, v2) * dout).sum().backward()
    cap = k.shape[2]  # the buffer holds the last `cap` positions (the keys before them were dropped)
    torch.testing.assert_close(q2.grad, q_all.grad[:, :, -lq:], rtol=0, atol=1e-10)
    torch.testing.assert_close(k2.grad, k_all.grad[:, :, -cap:], rtol=0, atol=1e-10)
    torch.testing.assert_close(v2.grad, v_all.grad[:, :, -cap:], rtol=0, atol=1e-10)
    assert not k_all.grad[:, :, :-cap].any()  # the dropped keys had no weight
