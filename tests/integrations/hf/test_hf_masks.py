"""Attention masks on swapped models. 4-D masks (issue 19, #13): BLOOM, MPT and Falcon refuse them with one clear
message (before, BLOOM and Falcon failed inside the stock model code, "too many values to unpack", building their
ALiBi tensor from the mask); the RoPE family takes custom 4-D masks without a KV cache (issue 34, transformers'
``test_custom_4d_attention_mask``), computed densely with positions from the position ids."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MODEL_TYPES, tiny_model, token_ids  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402

from conftest import naive_alibi, naive_estimator, naive_mean_mask  # noqa: E402

MESSAGE = r"unsupported attention mask \(2, 1, 10, 10\).*only a 2-D \(batch, seq_len\) padding mask"


NATIVE = ("bloom", "mpt", "falcon")  # the families whose stock forward builds its own mask / ALiBi tensor


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("name", NATIVE)
def test_4d_mask_refused_with_one_message(name, mode):
    model = tiny_model(name)
    x = token_ids(length=10)
    with hf.use_positional_lsh(model, num_samples=2) if mode == "plsh" else hf.use_alibi(model):
        for mask in (torch.zeros(2, 1, 10, 10), torch.ones(2, 1, 10, 10, dtype=torch.bool)):
            with pytest.raises(ValueError, match=MESSAGE):
                model(x, attention_mask=mask)
        with pytest.raises(ValueError, match=MESSAGE):  # the base model called with the mask as a positional argument
            base = model.base_model
            names = list(inspect.signature(base.forward).parameters)
            args = [None] * names.index("attention_mask") + [torch.zeros(2, 1, 10, 10)]
            args[names.index("input_ids")] = x
            base(*args)
        ok = model(x, attention_mask=torch.ones(2, 10, dtype=torch.long)).logits  # a 2-D padding mask is accepted
    assert torch.isfinite(ok).all()


def _swap_mode(model, mode):
    if mode == "plsh":
        return hf.use_positional_lsh(model, num_samples=4, seed=3)
    return hf.use_alibi(model) if mode == "alibi" else hf.use_alibi(model, window=2.0)


def _shared_prefix() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' custom-4-D-mask case: three sequences sharing 3 tokens, as one row of 6 whose last 3 tokens sit
    at position 3 each and see the prefix and themselves only. Returns (ids, shared ids, mask, shared positions)."""
    ids = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 12, 15]])
    shared = torch.cat([ids[0, :-1], ids[:, -1]])[None]
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    mask[4:, 3:] = torch.eye(3, dtype=torch.bool)[1:]
    return ids, shared, mask[None, None], torch.tensor([[0, 1, 2, 3, 3, 3]])


@pytest.mark.parametrize("mode", ["plsh", "alibi", "window"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_custom_4d_mask_with_a_shared_prefix_equals_the_sequences_one_by_one(name, mode):
    """Each branch's last token gets the logits of its own sequence run alone (the ops' path, no mask), with the mask
    bool or in transformers' float form (0 / finfo.min); the weights returned are the mask's pattern."""
    model = tiny_model(name)
    _swap_mode(model, mode)
    ids, shared, mask, pos = _shared_prefix()
    additive = (~mask).float() * torch.finfo(torch.float32).min
    with torch.no_grad():
        alone = model(ids).logits[:, -1]
        for m in (mask, additive):
            out = model(shared, attention_mask=m, position_ids=pos, output_attentions=True)
            torch.testing.assert_close(out.logits[0, 3:], alone, rtol=1e-5, atol=1e-5)
            for w in out.attentions:
                assert w.shape == (1, 4, 6, 6)
                assert bool((w[0][:, ~mask[0, 0]] == 0).all())
                torch.testing.assert_close(w.sum(-1), torch.ones(1, 4, 6))


@pytest.mark.parametrize("mode", ["plsh", "alibi", "window"])
def test_custom_4d_mask_of_a_padded_batch_equals_its_2d_mask(mode):
    """A 4-D mask that is the causal mask with holes (random padding) gives the valid positions of the 2-D mask's
    call (the ops' path with holes): positions are the position ids, here 0 .. L-1."""
    model = tiny_model("llama")
    _swap_mode(model, mode)
    x = token_ids(length=10)
    keep = torch.rand(2, 10, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[:, -1] = True
    four_d = (torch.tril(torch.ones(10, 10, dtype=torch.bool)) & keep[:, None, :])[:, None]
    with torch.no_grad():
        want = model(x, attention_mask=keep.long()).logits
        got = model(x, attention_mask=four_d).logits
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["plsh", "alibi", "window"])
def test_custom_4d_mask_attention_equals_the_float64_oracles(mode):
    """The custom-mask attention itself, float64: under the causal mask at positions 0 .. L-1 it is exact ALiBi by an
    explicit bias (windowed too) or the oracle ``softmax(s + log Mbar) v`` with ``Mbar`` from naive loops over the
    layer's partitions; at repeated positions (a shared prefix) each branch is its own sequence's oracle row; and its
    gradients pass gradcheck."""
    model = tiny_model("llama", dtype=torch.float64)
    swap = _swap_mode(model, mode)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None]

    def oracle(n: int, qq, kk, vv):
        if mode == "plsh":
            parts = swap.partitions(1, n)
            return naive_estimator(qq, kk, vv, naive_mean_mask(parts.pitch, parts.shift, n), causal=True, scale=0.3)
        return naive_alibi(qq, kk, vv, swap.slopes, causal=True, window=swap.window, scale=0.3)

    out, _ = swap.attend_custom_mask(1, False, q, k, v, causal, 0.3)
    torch.testing.assert_close(out, oracle(6, q, k, v), rtol=1e-10, atol=1e-10)
    _, _, mask, pos = _shared_prefix()
    swap.mask_positions = pos
    out, _ = swap.attend_custom_mask(1, False, q, k, v, mask, 0.3)
    for branch in range(3):
        rows = [0, 1, 2, 3 + branch]
        want = oracle(4, q[:, :, rows], k[:, :, rows], v[:, :, rows])[:, :, -1]
        torch.testing.assert_close(out[:, :, 3 + branch], want, rtol=1e-10, atol=1e-10)
    fn = lambda a, b, c: swap.attend_custom_mask(1, False, a, b, c, mask, 0.3)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()))
    swap.mask_positions = None


def test_custom_4d_mask_refusals_change_nothing():
    """One line each: a custom mask continuing a KV cache (the cache as it was), a mask of the wrong shape or dtype,
    float or negative position ids."""
    model = tiny_model("llama")
    hf.use_alibi(model)
    _, shared, mask, pos = _shared_prefix()
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(shared, past_key_values=cache, use_cache=True)
        cases = [
            (
                dict(attention_mask=torch.ones(1, 1, 1, 7, dtype=torch.bool), past_key_values=cache),
                "continue a KV cache",
            ),
            (dict(attention_mask=mask[..., :5]), r"must be \(batch or 1, 1 or heads, 6, 6\)"),
            (dict(attention_mask=mask.long()), "must be bool .* or float"),
            (dict(attention_mask=mask, position_ids=pos.float()), "position_ids with a custom 4-D attention_mask"),
            (dict(attention_mask=mask, position_ids=pos - 1), "non-negative"),
            (dict(attention_mask=torch.ones(1, 3, 6, 6, dtype=torch.bool)), r"1 or 4, 6, 6"),
        ]
        for kwargs, message in cases:
            with pytest.raises(ValueError, match=message) as err:
                model(shared if "past_key_values" not in kwargs else shared[:, :1], **kwargs)
            assert "\n" not in str(err.value)
        assert cache.get_seq_length() == 6


# ---------------------------------------------------------------------------------------------------------------------
# Issue 34, item 24: masks with holes (ops/padding.py: a masked key leaves the softmax, positions stay)
# ---------------------------------------------------------------------------------------------------------------------


def _swap(model, mode):
    return hf.use_positional_lsh(model, num_samples=4, seed=1) if mode == "plsh" else hf.use_alibi(model)


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("name", MODEL_TYPES)
def test_masked_tokens_change_nothing_at_valid_positions(name, mode):
    """A random mask with holes is taken by every family; the masked tokens reach no valid position (their ids can
    be anything), and the valid positions match the ops' own call on the same mask (the op-level tests compare that
    with the float64 dense oracle)."""
    model = tiny_model(name, dtype=torch.float64)
    x = token_ids(length=12)
    mask = torch.ones_like(x)
    mask[0, 3], mask[1, 0], mask[1, 7:9] = 0, 0, 0
    other = x.clone()
    other[0, 3], other[1, 0], other[1, 7] = 5, 6, 9
    with _swap(model, mode), torch.no_grad():
        a = model(x, attention_mask=mask).logits
        b = model(other, attention_mask=mask).logits
    valid = mask.bool()
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[valid], b[valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("name", ["bloom", "falcon", "llama", "qwen3"])
def test_generate_a_right_padded_prompt_with_and_without_cache(name, mode):
    """A right-padded prompt becomes holes under generate: the cached decode equals recomputing the whole sequence
    (the same mask, the same positions) at every step."""
    model = tiny_model(name, dtype=torch.float64)
    x = token_ids(length=10)
    mask = torch.ones_like(x)
    x[1, 6:], mask[1, 6:] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)  # fmt: skip
    with _swap(model, mode), torch.no_grad():
        cached = model.generate(x, use_cache=True, **kwargs)
        fresh = model.generate(x, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, fresh.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(fresh.scores), rtol=0, atol=1e-10)


@pytest.mark.parametrize("cache", ["live", "static"])
@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_holes_with_the_swaps_own_caches(name, mode, cache):
    """Left padding and a right-padded prompt (holes) with the swap's caches: a LiveKeyCache that drops dead keys
    (short blocks, a short window) and cache_implementation="static": the tokens and scores of no cache."""
    model = tiny_model(name, dtype=torch.float64)
    if mode == "plsh":
        swap = hf.use_positional_lsh(model, num_samples=4, seed=1, slopes=[2.0, 1.0, 0.5, 0.3])
    else:
        swap = hf.use_alibi(model, window=4.0)
    x = token_ids(length=10)
    mask = torch.ones_like(x)
    x[0, :2], mask[0, :2] = 0, 0
    x[1, 6:], mask[1, 6:] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)  # fmt: skip
    with swap, torch.no_grad():
        if cache == "live":
            got = model.generate(x, past_key_values=swap.new_cache(), **kwargs)
        else:
            got = model.generate(x, cache_implementation="static", **kwargs)
        fresh = model.generate(x, use_cache=False, **kwargs)
    assert torch.equal(got.sequences, fresh.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(fresh.scores), rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------------------
# Issue 34, item 25: packed sequences (position ids that restart; DataCollatorWithFlattening)
# ---------------------------------------------------------------------------------------------------------------------

DOCS = ((5, 2), (4, 3), (7, 4))  # (length, seed) of each packed document


def _docs():
    return [token_ids(batch=1, length=n, seed=seed) for n, seed in DOCS]


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("name", ["falcon", "llama", "qwen3"])
def test_packed_position_ids_equal_the_documents_one_by_one(name, mode):
    """Padding-free batches: position ids that restart make each document its own sequence (its positions, its
    blocks, no attention across documents), as running the documents one by one; whatever use_cache says."""
    model = tiny_model(name, dtype=torch.float64)
    docs = _docs()
    packed = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with _swap(model, mode), torch.no_grad():
        got = model(packed, position_ids=pos).logits
        got_no_cache = model(packed, position_ids=pos, use_cache=False).logits
        alone = torch.cat([model(d).logits for d in docs], dim=1)
        whole = model(packed).logits  # without the position ids: one sequence
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-10)
    assert torch.equal(got, got_no_cache)
    assert (whole - alone).abs().max() > 1e-3  # (the documents do see each other as one sequence)


def test_packed_rows_of_a_batch_are_packed_apart():
    model = tiny_model("llama", dtype=torch.float64)
    docs = _docs()
    row0 = torch.cat(docs, dim=1)
    row1 = torch.cat([docs[2], docs[0], docs[1]], dim=1)
    pos0 = torch.cat([torch.arange(d.shape[1]) for d in docs])
    pos1 = torch.cat([torch.arange(d.shape[1]) for d in (docs[2], docs[0], docs[1])])
    with _swap(model, "plsh"), torch.no_grad():
        got = model(torch.cat([row0, row1]), position_ids=torch.stack([pos0, pos1])).logits
        alone = [model(d).logits for d in docs]
    torch.testing.assert_close(got[0], torch.cat(alone, 1)[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], torch.cat([alone[2], alone[0], alone[1]], 1)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("position_ids", [True, False])
def test_flattening_collator_batches_train_as_the_documents(position_ids):
    """transformers' DataCollatorWithFlattening, with its flash-attention keywords (cu_seq_lens_k) and with or without
    position ids: the loss and its gradients equal those of the documents one by one (the same partitions: training
    without resampling)."""
    from transformers import DataCollatorWithFlattening

    model = tiny_model("llama", dtype=torch.float64)
    docs = _docs()
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=position_ids)
    batch = collate([{"input_ids": d[0].tolist()} for d in docs], return_tensors="pt")
    assert "cu_seq_lens_k" in batch and ("position_ids" in batch) == position_ids
    swap = hf.use_positional_lsh(model, num_samples=4, seed=1, resample_in_training=False)
    model.train()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    alone = torch.cat([model(d).logits for d in docs], dim=1)
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-10)
    w = [p for p in model.parameters() if p.requires_grad]
    up = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=logits.dtype)
    for a, b in zip(torch.autograd.grad(logits, w, up), torch.autograd.grad(alone, w, up), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        model(batch["input_ids"], cu_seq_lens_k=torch.tensor([0, 5, 3, 16]), cu_seq_lens_q=batch["cu_seq_lens_q"])
    swap.restore()


def test_packed_attention_weights_are_block_diagonal():
    model = tiny_model("llama", dtype=torch.float64)
    docs = _docs()
    packed = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with _swap(model, "plsh"), torch.no_grad():
        got = model(packed, position_ids=pos, output_attentions=True).attentions
        alone = [model(d, output_attentions=True).attentions for d in docs]
    start = 0
    for i, d in enumerate(docs):
        n = d.shape[1]
        doc = slice(start, start + n)
        for layer, want in zip(got, (a[i] for a in zip(*alone, strict=True)), strict=True):
            torch.testing.assert_close(layer[:, :, doc, doc], want, rtol=0, atol=1e-12)
            assert not layer[:, :, doc, :start].any()
        start += n


def test_packed_sequences_cannot_continue_a_cache():
    model = tiny_model("llama")
    docs = _docs()
    with _swap(model, "alibi"), torch.no_grad():
        cache = model(docs[0], use_cache=True).past_key_values
        pos = torch.cat([torch.arange(3), torch.arange(4)])[None]
        with pytest.raises(ValueError, match="cannot continue a KV cache"):
            model(torch.cat([docs[1], docs[0][:, :3]], 1), position_ids=pos + 0, past_key_values=cache)
