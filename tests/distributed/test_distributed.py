"""Context parallelism (positional_lsh.distributed): halo planning, and P gloo processes == one process.

The multi-process tests spawn a few CPU processes (gloo, file store, short timeouts) that each run many cases
and write their results to a JSON file; the parent process checks them. NCCL tests need GPUs and are skipped.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from positional_lsh import alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.distributed import (
    block_extents,
    bytes_per_rank,
    comm_stats,
    context_parallel_plsh_attention,
    crop_partitions,
    exchange_bytes,
    halo_plan,
    reset_comm_stats,
)

from conftest import run_torchrun

TOL = 1e-10
JOIN_TIMEOUT_S = 150.0


# ----------------------------------------------------------------------------------------------------------
# Planning (no process group)
# ----------------------------------------------------------------------------------------------------------


def _brute_window(partitions, start: int, end: int, causal: bool) -> tuple[int, int]:
    lab = partitions.labels()  # (T, H, n)
    left, right = start, end
    for t in range(partitions.num_samples):
        for h in range(partitions.num_heads):
            row = lab[t, h]
            left = min(left, int((row == row[start]).nonzero().min()))
            if not causal:
                right = max(right, int((row == row[end - 1]).nonzero().max()) + 1)
    return left, right


@pytest.mark.parametrize("scheme", ["discrete", "gamma", "discrete-strat"])
def test_block_extents_and_crop_match_labels(scheme):
    p = sample_partitions(600, torch.tensor([0.7, 0.05, 0.004, 0.0]), 5, scheme=scheme, generator=3)
    lab = p.labels()
    start, end = block_extents(p, torch.arange(600))
    for t in range(5):
        for h in range(4):
            row = lab[t, h]
            assert torch.equal(start[t, h], torch.searchsorted(row, row))
            assert torch.equal(end[t, h], torch.searchsorted(row, row, right=True))
    for a, b in [(0, 600), (17, 333), (299, 300), (250, 599)]:
        c = crop_partitions(p, a, b, verify=True)
        cl = c.labels()
        assert c.seq_len == b - a
        assert torch.equal(cl[..., 1:] != cl[..., :-1], lab[..., a + 1 : b] != lab[..., a : b - 1])


def test_crop_keeps_decay_and_cap_fields():
    """A crop of decay or capped partitions keeps ``decays``, ``decay_len`` and ``max_block`` (same blocks)."""
    from positional_lsh.ops.partitions.decays import power_decay

    p = sample_partitions(300, None, 4, num_heads=2, decay=[power_decay(0.5, 1.0), power_decay(1.5, 0.1)], generator=2)
    capped = sample_partitions(300, alibi_slopes(2), 4, generator=2, max_block=16)
    for parts in (p, capped):
        c = crop_partitions(parts, 40, 250)
        assert (c.decays, c.decay_len, c.max_block, c.scheme) == (parts.decays, parts.decay_len, parts.max_block,
                                                                 parts.scheme)  # fmt: skip
        assert c.unbiased == parts.unbiased
        lab, cl = parts.labels(), c.labels()
        assert torch.equal(cl[..., 1:] != cl[..., :-1], lab[..., 41:250] != lab[..., 40:249])
    assert crop_partitions(capped, 0, 100).with_seq_len(300).max_block == 16
    with pytest.raises(ValueError, match="exact only up to"):
        crop_partitions(p, 0, 100).with_seq_len(301)


@pytest.mark.parametrize("causal", [True, False])
def test_halo_plan_is_exact(causal):
    p = sample_partitions(500, torch.tensor([0.3, 1 / 64, 1 / 400]), 6, generator=5)
    lengths = [90, 0, 160, 1, 249]
    plan = halo_plan(p, lengths, causal=causal)
    pos = 0
    for r, n_r in enumerate(lengths):
        if n_r:
            assert (plan.left[r], plan.right[r]) == _brute_window(p, pos, pos + n_r, causal)
        pos += n_r
        # The transfers cover the halo exactly once, each piece from its owner.
        got = sorted((tr.start, tr.end) for tr in plan.incoming(r))
        covered = sum(e - s for s, e in got)
        assert covered == plan.halo_positions(r)
        for tr in plan.incoming(r):
            assert plan.starts[tr.src] <= tr.start < tr.end <= plan.ends[tr.src]
    if causal:
        assert plan.right == plan.ends
    b = bytes_per_rank(plan, batch=2, kv_heads=3, head_dim=4, dtype=torch.float64)
    assert sum(b["sent"]) == sum(b["received"]) == sum(plan.halo_positions(r) for r in range(5)) * 2 * 2 * 3 * 4 * 8


def test_ring_and_allgather_accounting():
    kw = {"kv_heads": 8, "head_dim": 64, "dtype": torch.float32}
    forward = 3 * 256 * 2 * 8 * 64 * 4  # the other 3 shards' 256 positions of keys and values, float32
    assert exchange_bytes(1024, 4, **kw) == exchange_bytes(1024, 4, exchange="allgather", **kw) == forward
    assert exchange_bytes(1024, 4, backward=True, **kw) == 3 * forward
    assert exchange_bytes(1024, 4, exchange="allgather", backward=True, **kw) == 2 * forward
    with pytest.raises(ValueError, match="exchange must be one of"):
        exchange_bytes(1024, 4, exchange="tree", **kw)


def test_no_process_group_falls_back_to_plsh_attention():
    assert not dist.is_initialized()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = context_parallel_plsh_attention(q, k, v, generator=7, num_samples=3)
    ref = plsh_attention(q, k, v, generator=7, num_samples=3)
    assert torch.equal(out, ref)
    for method in ("samples", "multiplicity"):
        out = context_parallel_plsh_attention(q, k, v, generator=7, num_samples=3, backend="math", method=method)
        assert torch.equal(out, plsh_attention(q, k, v, generator=7, num_samples=3, backend="math", method=method))
    with pytest.raises(ValueError, match="method must be one of"):
        context_parallel_plsh_attention(q, k, v, generator=7, method="fast")
    with pytest.raises(ValueError, match="backend must be one of"):
        context_parallel_plsh_attention(q, k, v, generator=7, backend="cuda")
    with pytest.raises(TypeError, match="causal must be a bool"):
        context_parallel_plsh_attention(q, k, v, generator=7, causal=1)
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
        context_parallel_plsh_attention(q.tolist(), k, v, generator=7)
    with pytest.raises(ValueError, match="shard_lengths"):
        context_parallel_plsh_attention(q, k, v, generator=7, shard_lengths=[63])


def test_check_slopes_match():
    from positional_lsh.ops.partitions.partition import check_slopes_match

    p = sample_partitions(64, alibi_slopes(4), 2, generator=0)
    check_slopes_match(None, p, 4)
    check_slopes_match(alibi_slopes(4), p, 4)
    check_slopes_match(alibi_slopes(4).tolist(), p, 4)
    check_slopes_match([0.5] * 2, p, 2)  # partitions for other heads: check_partitions's to report
    with pytest.raises(ValueError, match=r"slopes differ from partitions\.slopes; pass one or the other"):
        check_slopes_match(0.5, p, 4)
    with pytest.raises(ValueError, match="one entry per head"):
        check_slopes_match([0.5] * 3, p, 4)


def _recording(module, seen: list):
    """A stand-in for ``module.plsh_attention`` that records each call's ``(backend, method)`` and computes."""
    real = module.plsh_attention

    def call(*args, **kwargs):
        seen.append((kwargs.get("backend"), kwargs.get("method")))
        return real(*args, **kwargs)

    return call


def test_lm_hook_passes_the_model_backend_and_method(monkeypatch):
    """Under context parallelism the language model's ``attn_backend`` and ``plsh_method`` reach the attention."""
    import positional_lsh.distributed.attention as cp_attention
    from positional_lsh import ModelConfig, TransformerLM
    from positional_lsh.distributed import ContextShards

    cfg = ModelConfig(vocab_size=61, seq_len=32, n_layer=2, n_head=2, d_model=16, position="plsh", sigma=8.0,
                      attn_backend="math", plsh_method="samples")  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(cfg).double().eval()
    idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = model(idx)
    seen: list = []
    monkeypatch.setattr(cp_attention, "plsh_attention", _recording(cp_attention, seen))
    out = model(idx, context=ContextShards(object(), shard_lengths=[32]))  # no process group: one rank, plsh_attention
    assert seen == [("math", "samples")] * cfg.n_layer
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------------------------
# Multi-process (gloo on CPU)
# ----------------------------------------------------------------------------------------------------------


def _data(n: int, hq: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, hkv, n, d, generator=g, dtype=torch.float64)
    w = torch.randn(2, hq, n, d, generator=g, dtype=torch.float64)
    return q, k, v, w


def _compare(rank: int, lengths: list[int], *, causal: bool, slopes, scheme: str, hq: int, hkv: int, **kw) -> float:
    """Max abs error of this rank's out, dq, dk, dv against one process on the whole sequence."""
    n, d = sum(lengths), 8
    q, k, v, w = _data(n, hq, hkv, d, seed=n + hq)
    s, e = sum(lengths[:rank]), sum(lengths[: rank + 1])
    opts = {"num_samples": 4, "scheme": scheme, "generator": 11, "causal": causal}
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    ref = plsh_attention(qf, kf, vf, slopes, **opts)
    (ref * w).sum().backward()
    ql, kl, vl = (x[:, :, s:e].clone().requires_grad_() for x in (q, k, v))
    out = context_parallel_plsh_attention(ql, kl, vl, slopes, **opts, **kw)
    (out * w[:, :, s:e]).sum().backward()
    pairs = [(out, ref[:, :, s:e]), (ql.grad, qf.grad[:, :, s:e]), (kl.grad, kf.grad[:, :, s:e])]
    pairs.append((vl.grad, vf.grad[:, :, s:e]))
    return max((float((a.detach() - b).abs().max()) for a, b in pairs if a.numel()), default=0.0)


def _compare_partitions(rank: int, lengths: list[int], partitions, *, causal: bool, hkv: int, **kw) -> float:
    """Like :func:`_compare`, for given whole-sequence partitions (the reference gets the same backend/method)."""
    n, d, hq = sum(lengths), 8, partitions.num_heads
    q, k, v, w = _data(n, hq, hkv, d, seed=n + hq)
    s, e = sum(lengths[:rank]), sum(lengths[: rank + 1])
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    options = {key: kw[key] for key in ("backend", "method") if key in kw}
    ref = plsh_attention(qf, kf, vf, partitions=partitions, causal=causal, **options)
    (ref * w).sum().backward()
    ql, kl, vl = (x[:, :, s:e].clone().requires_grad_() for x in (q, k, v))
    out = context_parallel_plsh_attention(ql, kl, vl, partitions=partitions, causal=causal, **kw)
    (out * w[:, :, s:e]).sum().backward()
    pairs = [(out, ref[:, :, s:e]), (ql.grad, qf.grad[:, :, s:e]), (kl.grad, kf.grad[:, :, s:e])]
    pairs.append((vl.grad, vf.grad[:, :, s:e]))
    return max(float((a.detach() - b).abs().max()) for a, b in pairs)


def _cases_decay(rank: int) -> dict[str, object]:
    """Decay (heavy-tailed power decay: long blocks cross the boundary) and capped partitions on 2 ranks."""
    from positional_lsh.ops.partitions.decays import power_decay

    res: dict[str, object] = {}
    decays = [power_decay(0.5, 1.0), power_decay(1.5, 0.1), power_decay(0.8, 0.5), power_decay(2.0, 1.0)]
    parts = {
        "decay": sample_partitions(160, None, 4, num_heads=4, decay=decays, generator=5),
        "capped": sample_partitions(160, [1 / 500, 1 / 8, 0.0, 0.05], 4, generator=5, max_block=24),
        "capped_gamma": sample_partitions(160, [1 / 500, 0.3], 4, scheme="gamma", generator=5, max_block=30),
    }
    for name, p in parts.items():
        for causal in (True, False):
            c = "causal" if causal else "bidir"
            res[f"{name}_{c}"] = _compare_partitions(rank, [70, 90], p, causal=causal, hkv=2)
            res[f"{name}_{c}_chunk1"] = _compare_partitions(rank, [70, 90], p, causal=causal, hkv=2, head_chunk=1)
    # A blocks crosses the shard boundary, so the halo is really used.
    res["halo"] = halo_plan(parts["decay"], [70, 90], causal=True).halo_positions(1)
    return res


def _expect_value_error(fn) -> str:
    """``"ValueError: message"`` (or ``"TypeError: ..."``) of what ``fn()`` raises, else ``"no error"``."""
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "no error"


def _cases_options(rank: int) -> dict[str, object]:
    """backend= and method= on 2 ranks reach every local plsh_attention call (plain and head-chunked), and the
    result equals one process with the same partitions and options; bad options fail alike on every rank."""
    import positional_lsh.distributed.chunked as cp_chunked

    res: dict[str, object] = {}
    p = sample_partitions(160, [1 / 500, 1 / 8, 0.0, 0.05], 4, generator=5)
    seen: list = []
    real = cp_chunked.plsh_attention
    cp_chunked.plsh_attention = _recording(cp_chunked, seen)
    try:
        for method in ("samples", "multiplicity"):
            for chunk in (None, 1):
                for causal in (True, False):
                    key = f"{method}_chunk{chunk}_{'causal' if causal else 'bidir'}"
                    seen.clear()
                    opts = {"backend": "math", "method": method, "head_chunk": chunk}
                    res[key] = _compare_partitions(rank, [70, 90], p, causal=causal, hkv=2, **opts)
                    res[f"seen_{key}"] = sorted(set(seen))
    finally:
        cp_chunked.plsh_attention = real
    res["halo"] = halo_plan(p, [70, 90], causal=True).halo_positions(1)
    q, k, v, _ = _data(160, 4, 2, 8, seed=3)
    ql, kl, vl = (x[:, :, 70 * rank : 70 + 90 * rank] for x in (q, k, v))
    res["err_method"] = _expect_value_error(lambda: context_parallel_plsh_attention(ql, kl, vl, partitions=p, method=1))
    res["err_backend"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, partitions=p, backend="fast")
    )
    res["err_causal"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, partitions=p, causal="yes")
    )
    res["err_slopes"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, [0.5] * 4, partitions=p)
    )
    # A bad argument on rank 1 only (each of these used to be raised by rank 1 alone, before the exchange, and
    # left rank 0 waiting in it): both ranks raise the same ValueError naming rank 1 and its error, nobody hangs.
    one_rank = {
        "q_list": {"q": ql.tolist()},
        "causal_1": {"causal": 1},
        "generator_none": {"partitions": None, "generator": None},
        "head_chunk_0": {"head_chunk": 0},
        "partitions_str": {"partitions": "x"},
        "shard_lengths_str": {"shard_lengths": "ab"},
        "scale_negative": {"scale": -1.0},
        "slopes_bad": {"partitions": None, "generator": 3, "slopes": [0.5, float("nan"), 0.1, 0.2]},
        "num_samples_0": {"partitions": None, "generator": 3, "num_samples": 0},
    }
    for name, bad in one_rank.items():
        kw = {"q": ql, "k": kl, "v": vl, "partitions": p, **(bad if rank == 1 else {})}
        if "generator" in bad and rank != 1:
            kw.update(partitions=None, generator=3)
        res[f"err_one_rank_{name}"] = _expect_value_error(lambda kw=kw: context_parallel_plsh_attention(**kw))
    res["after_errors"] = _compare_partitions(rank, [70, 90], p, causal=True, hkv=2, method="multiplicity")
    return res


def _cases_4(rank: int) -> dict[str, object]:
    res: dict[str, object] = {}
    equal = [128, 128, 128, 128]
    unequal = [100, 37, 300, 75]
    with_empty = [200, 0, 212, 100]
    for causal in (True, False):
        c = "causal" if causal else "bidir"
        res[f"{c}_equal_gqa"] = _compare(rank, equal, causal=causal, slopes=None, scheme="discrete", hq=4, hkv=2)
        res[f"{c}_unequal"] = _compare(rank, unequal, causal=causal, slopes=None, scheme="discrete", hq=4, hkv=4)
        res[f"{c}_empty_shard"] = _compare(
            rank, with_empty, causal=causal, slopes=[0.3, 0.01], scheme="gamma", hq=2, hkv=1
        )
        big = [1 / 2000, 1 / 2000, 1 / 8, 0.0]
        res[f"{c}_big_sigma"] = _compare(rank, equal, causal=causal, slopes=big, scheme="discrete", hq=4, hkv=2)
        res[f"{c}_big_sigma_gamma"] = _compare(rank, equal, causal=causal, slopes=big, scheme="gamma", hq=4, hkv=1)
        # Heads in chunks, recomputed in the backward (head_chunk): the same values and gradients.
        res[f"{c}_chunk3_big_sigma"] = _compare(
            rank, unequal, causal=causal, slopes=big, scheme="discrete", hq=4, hkv=4, head_chunk=3
        )
        res[f"{c}_chunk1_empty_gqa"] = _compare(
            rank, with_empty, causal=causal, slopes=None, scheme="gamma", hq=4, hkv=2, head_chunk=1
        )
    res["given_lengths"] = _compare(
        rank, unequal, causal=True, slopes=None, scheme="discrete", hq=4, hkv=2, shard_lengths=unequal
    )
    # The big-sigma plan really spans several ranks.
    p = sample_partitions(512, [1 / 2000, 1 / 2000], 4, generator=11)
    plan = halo_plan(p, equal, causal=True)
    res["multi_rank_halo"] = len({tr.src for tr in plan.incoming(3)})
    # Bytes that went through isend == the plan's count (forward and backward).
    p = sample_partitions(512, alibi_slopes(4), 4, generator=11)
    plan = halo_plan(p, unequal, causal=False)
    q, k, v, _ = _data(512, 4, 2, 8, seed=1)
    s, e = sum(unequal[:rank]), sum(unequal[: rank + 1])
    ql, kl, vl = (x[:, :, s:e].clone().requires_grad_() for x in (q, k, v))
    reset_comm_stats()
    context_parallel_plsh_attention(ql, kl, vl, partitions=p, causal=False).sum().backward()
    stats = comm_stats()
    want = bytes_per_rank(plan, batch=2, kv_heads=2, head_dim=8, dtype=torch.float64)
    res["bytes"] = [stats["forward_bytes"], stats["backward_bytes"], want["sent"][rank], want["received"][rank]]
    # Bad input: every rank raises ValueError, nobody hangs.
    ql, kl, vl = (x[:, :, rank * 128 : (rank + 1) * 128] for x in _data(512, 4, 2, 8, seed=2)[:3])
    if rank == 2:
        ql, kl, vl = ql[..., :4], kl[..., :4], vl[..., :4]
    res["err_head_dim"] = _expect_value_error(lambda: context_parallel_plsh_attention(ql, kl, vl, generator=1))
    ql, kl, vl = (x[:, :, rank * 128 : (rank + 1) * 128] for x in _data(512, 4, 2, 8, seed=2)[:3])
    res["err_seeds"] = _expect_value_error(lambda: context_parallel_plsh_attention(ql, kl, vl, generator=rank))
    p0 = sample_partitions(512, alibi_slopes(4), 2, generator=0)
    p1 = sample_partitions(512, alibi_slopes(4), 2, generator=1)
    res["err_partitions"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, partitions=p1 if rank == 3 else p0)
    )
    res["err_sum"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, generator=1, shard_lengths=[128, 128, 128, 129])
    )
    res["err_negative"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, generator=1, shard_lengths=[128, -1, 257, 128])
    )
    res["err_generator"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(ql, kl, vl, generator=torch.Generator().manual_seed(0))
    )
    res["err_mixed_lengths"] = _expect_value_error(
        lambda: context_parallel_plsh_attention(
            ql, kl, vl, generator=1, shard_lengths=[128] * 4 if rank else [64, 192, 128, 128]
        )
    )
    # Still in step after the errors.
    res["after_errors"] = _compare(rank, equal, causal=True, slopes=None, scheme="discrete", hq=4, hkv=2)
    return res


def _cases_lm(rank: int) -> dict[str, object]:
    """One training step of a tiny plsh language model: 2 context-parallel ranks == one process."""
    import torch.nn.functional as F

    from positional_lsh import ModelConfig, TransformerLM
    from positional_lsh.distributed import ContextShards, shard_sequence

    # sigma = 40 on 96 tokens over 2 ranks: blocks cross the shard boundary.
    cfg = ModelConfig(vocab_size=97, seq_len=96, n_layer=2, n_head=4, d_model=32, position="plsh", sigma=40.0)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 97, (2, 96), generator=g)
    tgt = torch.randint(0, 97, (2, 96), generator=g)
    res: dict[str, object] = {}
    torch.manual_seed(0)
    ref = TransformerLM(cfg).double().train()
    _, loss_ref = ref(idx, tgt)
    loss_ref.backward()
    torch.manual_seed(0)
    model = TransformerLM(cfg).double().train()
    logits = model(shard_sequence(idx), context=ContextShards(dist.group.WORLD))
    local = shard_sequence(tgt)
    loss = F.cross_entropy(logits.flatten(0, 1), local.flatten(), reduction="sum") / tgt.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    res["loss"] = abs(float(total - loss_ref))
    err = 0.0
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        err = max(err, float((grad - p_ref.grad).abs().max()))
    res["grads"] = err
    return res


def _cases_train(rank: int) -> dict[str, object]:
    """The training path of ``plsh train --context-parallel 2`` (world 2: 1 x 2, world 4: data 2 x context 2).

    One step of a tiny float32 plsh model through ``setup_context_parallel`` (groups, shards, DDP over the world)
    against one process on the whole global batch. 95 tokens: unequal shards (48 + 47), so the loss factor is used.
    """
    from positional_lsh import ModelConfig, TransformerLM
    from positional_lsh.distributed import init_context_groups
    from positional_lsh.distributed.training import setup_context_parallel

    world = dist.get_world_size()
    res: dict[str, object] = {}
    _, ctx_probe = init_context_groups(2)
    res["ctx_ranks"] = dist.get_process_group_ranks(ctx_probe)
    data_probe, _ = init_context_groups(2)
    res["data_ranks"] = dist.get_process_group_ranks(data_probe)
    res["err_divide"] = _expect_value_error(lambda: init_context_groups(3))

    cfg = ModelConfig(vocab_size=97, seq_len=95, n_layer=2, n_head=4, d_model=32, position="plsh", sigma=40.0)
    g = torch.Generator().manual_seed(0)
    rows = 2 * (world // 2)  # batch 2 per data replica
    idx = torch.randint(0, 97, (rows, 95), generator=g)
    tgt = torch.randint(0, 97, (rows, 95), generator=g)
    torch.manual_seed(0)
    ref = TransformerLM(cfg).train()
    _, loss_ref = ref(idx, tgt)
    loss_ref.backward()
    torch.manual_seed(0)
    model = TransformerLM(cfg).train()
    # world 4 also runs the attention with heads in chunks, recomputed in the backward.
    cp, ddp = setup_context_parallel(2, model, 95, torch.device("cpu"), head_chunk=1 if world == 4 else None)
    res["shard"] = [cp.data_rank, cp.context_rank, cp.start, cp.end]
    _, loss = ddp(cp.local(idx), cp.local(tgt))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    total /= world
    res["loss"] = abs(float(total - loss_ref.detach())) / float(loss_ref)
    err = scale = 0.0
    for p_ref, p in zip(ref.parameters(), model.parameters(), strict=True):
        err = max(err, float((p.grad - p_ref.grad).abs().max()))
        scale = max(scale, float(p_ref.grad.abs().max()))
    res["grads"] = err / scale
    # Every rank holds the same reduced gradients.
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    res["grads_equal"] = all(torch.equal(gathered[0], x) for x in gathered)
    return res


def _worker(rank: int, world: int, store: str, out_dir: str, cases: str) -> None:
    torch.set_num_threads(1)
    result: dict[str, object] = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
        )
        result = globals()[cases](rank)
        dist.barrier()
    except Exception:
        result["crash"] = traceback.format_exc()
    finally:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


# The rank processes are forked from a forkserver that has imported torch, torch._dynamo (which DDP imports), the
# package and this module once (a fresh process, not a fork of pytest): a spawned rank spent ~3-5 s of CPU importing
# them, every rank of every test. Where there is no forkserver (Windows), they are spawned.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "positional_lsh",
            "positional_lsh.distributed", "positional_lsh.distributed.training", __name__]  # fmt: skip


def _context():
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first _spawn of this process
    return ctx


def _spawn(world: int, cases: str, tmp_path: Path) -> list[dict[str, object]]:
    ctx = _context()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_worker, args=(r, world, store, str(tmp_path), cases)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    for p in procs:
        p.join(max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    assert not hung, f"{len(hung)} process(es) hung"
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return results


def test_context_parallel_four_ranks(tmp_path):
    results = _spawn(4, "_cases_4", tmp_path)
    for r, res in enumerate(results):
        for key, val in res.items():
            if isinstance(val, float):
                assert val < TOL, f"rank {r} {key}: max error {val}"
        assert res["multi_rank_halo"] >= 2
        fwd, bwd, sent, recv = res["bytes"]
        assert fwd == sent and bwd == recv, f"rank {r}: measured {fwd}/{bwd}, planned {sent}/{recv}"
        for key in ("err_head_dim", "err_seeds", "err_partitions", "err_sum", "err_negative", "err_generator"):
            assert res[key].startswith("ValueError"), f"rank {r} {key}: {res[key]}"
        assert res["err_mixed_lengths"].startswith("ValueError")


def test_context_parallel_decay_and_capped_partitions(tmp_path):
    """Decay and capped (max_block) partitions on 2 ranks == plsh_attention on the whole sequence."""
    for r, res in enumerate(_spawn(2, "_cases_decay", tmp_path)):
        assert res.pop("halo") > 0
        for key, val in res.items():
            assert val < TOL, f"rank {r} {key}: max error {val}"


def test_context_parallel_backend_and_method(tmp_path):
    """backend= and method= reach the local computation; each method equals one process with the same options.
    A bad argument on one rank only: every rank raises the same ValueError, and the group stays usable."""
    results = _spawn(2, "_cases_options", tmp_path)
    for r, res in enumerate(results):
        assert res.pop("halo") > 0
        for method in ("samples", "multiplicity"):
            for chunk in (None, 1):
                for c in ("causal", "bidir"):
                    key = f"{method}_chunk{chunk}_{c}"
                    assert res[key] < TOL, f"rank {r} {key}: max error {res[key]}"
                    assert res[f"seen_{key}"] == [["math", method]], f"rank {r} {key}: {res[f'seen_{key}']}"
        every = "ValueError: invalid input on rank(s) [0, 1] of the context-parallel group (ranks 0, 1: "
        assert res["err_method"].startswith(every + "ValueError: method must be one of"), res["err_method"]
        assert res["err_backend"].startswith(every + "ValueError: backend must be one of"), res["err_backend"]
        assert res["err_causal"].startswith(every + "TypeError: causal must be a bool"), res["err_causal"]
        assert res["err_slopes"].startswith(every + "ValueError: slopes differ from partitions.slopes"), res
        assert res["after_errors"] < TOL
    rank0, rank1 = results
    for name, what in [("q_list", "TypeError: q must be a torch.Tensor"), ("causal_1", "TypeError: causal must be"),
                       ("generator_none", "ValueError: context parallelism needs the same partitions"),
                       ("head_chunk_0", "ValueError: head_chunk must be >= 1"),
                       ("partitions_str", "TypeError: partitions must be a Partitions"),
                       ("shard_lengths_str", "TypeError: shard_lengths must be a sequence"),
                       ("scale_negative", "ValueError: scale must be a positive"),
                       ("slopes_bad", "ValueError: slopes must be finite"),
                       ("num_samples_0", "ValueError: num_samples must be >= 1")]:  # fmt: skip
        key = f"err_one_rank_{name}"
        assert rank0[key] == rank1[key], (name, rank0[key], rank1[key])  # the same error on every rank
        assert rank0[key].startswith(f"ValueError: invalid input on rank(s) [1] of the context-parallel group "
                                     f"(rank 1: {what}"), (name, rank0[key])  # fmt: skip


def test_context_parallel_lm_step(tmp_path):
    for r, res in enumerate(_spawn(2, "_cases_lm", tmp_path)):
        # The model returns float32 logits (by design), so the loss agrees to float32 rounding; gradients to fp64.
        assert res["loss"] < 1e-5 and res["grads"] < TOL, f"rank {r}: {res}"


# float32 end to end: the reference and the shards sum the same terms in different orders and shapes (per-shard
# loss means, DDP's all-reduce, attention on a halo window), so they agree only to float32 rounding (unit roundoff
# 2**-24 ~ 6e-8). Measured: loss 0-1e-7 relative, gradients 3e-7 of the largest gradient entry (max abs difference
# over all parameters / max abs gradient). 5e-6 (~80 ulps) allows for summation order; a real error (a wrong
# shard, partition or token weighting) is >= 1e-3.
FP32_REL_TOL = 5e-6


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_training_step(tmp_path, world):
    """setup_context_parallel: one step on world = data x 2 ranks == one process on the whole global batch."""
    results = _spawn(world, "_cases_train", tmp_path)
    for r, res in enumerate(results):
        block = r // 2
        assert res["ctx_ranks"] == [2 * block, 2 * block + 1], res
        assert res["data_ranks"] == list(range(r % 2, world, 2)), res
        assert res["err_divide"].startswith("ValueError") and "divide" in res["err_divide"]
        assert res["shard"] == [r // 2, r % 2, 0 if r % 2 == 0 else 48, 48 if r % 2 == 0 else 95]
        assert res["loss"] < FP32_REL_TOL and res["grads"] < FP32_REL_TOL, f"rank {r}: {res}"
        assert res["grads_equal"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs at least two GPUs")
def test_nccl_placeholder():  # pragma: no cover - exercised on GPU machines only
    pytest.skip("NCCL path is the same code with device tensors; not run on CPU CI")


if os.environ.get("PLSH_DIST_DEBUG"):  # pragma: no cover
    torch.autograd.set_detect_anomaly(True)


def test_plsh_train_context_parallel_cli(tmp_path):
    """``torchrun --nproc_per_node 2 plsh train --context-parallel 2`` == one process (same batch, 2 steps)."""
    from positional_lsh.cli import train as cli_train
    from positional_lsh.lm import data as D
    from positional_lsh.lm import load_checkpoint

    texts = tmp_path / "texts"
    texts.mkdir()
    docs = D.load_corpus()
    for i, doc in enumerate(docs[:4] + docs[20:26]):
        (texts / f"doc{i:02d}.txt").write_text(doc.text[:6000], encoding="utf-8")
    tok = D.train_tokenizer(D.load_splits(str(texts))["train"], 300).save(tmp_path / "tokenizer.json")
    # seq_len 33 over 2 ranks: unequal shards (17 + 16); sigma 12: blocks cross the shard boundary.
    args = ["--data", str(texts), "--tokenizer", str(tok), "--cache-dir", "", "--seq-len", "33", "--n-layer", "2",
            "--n-head", "2", "--d-model", "32", "--position", "plsh", "--num-samples", "2", "--sigma", "12",
            "--batch-size", "2", "--steps", "2", "--warmup", "1", "--lr", "3e-3", "--eval-interval", "2",
            "--eval-batches", "2", "--autocast", "float32", "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "positional_lsh.cli", "train", "--out", str(tmp_path / "cp"), "--context-parallel", "2", *args]
    proc = run_torchrun(cmd, env, done="checkpoint in")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cpu x 2 (data 1 x context 2)" in proc.stdout
    assert cli_train.main(["--out", str(tmp_path / "1"), *args]) == 0
    cp, single = load_checkpoint(tmp_path / "cp"), load_checkpoint(tmp_path / "1")
    # Adam divides each gradient entry by its own magnitude, so an entry whose gradient is near Adam's eps (1e-8)
    # turns float32 rounding of the gradient into a visible update difference (seen: one of 4,096 entries off by
    # 1.3e-5 after 2 steps of lr 3e-3). So: nearly all entries to 1e-5, every entry well within one step's update.
    for (name, a), b in zip(cp.model.state_dict().items(), single.model.state_dict().values(), strict=True):
        diff = (a - b).abs()
        assert float(diff.max()) < 3e-4 and float((diff > 1e-5).float().mean()) < 1e-3, (name, float(diff.max()))
    logs = [[json.loads(line) for line in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in ("cp", "1")]
    for key in ("loss", "val_loss", "tokens"):
        got, want = ([r[key] for r in log if key in r] for log in logs)
        assert got == pytest.approx(want, rel=1e-5), key
    assert cp.metadata["world_size"] == 2 and cp.metadata["train_config"]["context_parallel"] == 2


def test_plsh_train_context_parallel_refusals(tmp_path, capsys, monkeypatch):
    """One-line errors: a non-plsh position, and a context size that does not divide the world size."""
    from positional_lsh.cli import train as cli_train

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli_train.main(["--out", str(tmp_path / "a"), "--context-parallel", "2", "--position", "alibi"]) == 2
    assert "needs --position plsh" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli_train.main(["--out", str(tmp_path / "b"), "--context-parallel", "2", "--position", "plsh"]) == 2
    err = capsys.readouterr().err
    assert "must divide the number of processes (3" in err and len(err.strip().splitlines()) == 1
