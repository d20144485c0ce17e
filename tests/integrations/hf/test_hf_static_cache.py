"""``generate(..., cache_implementation="static")`` on a swapped model (issue 34, item 26): a fixed-capacity cache
(:class:`~positional_lsh.integrations.hf.static_cache.LiveKeyStaticCache`) that decodes as the default dynamic cache
and as decoding without a cache, under ``torch.compile`` too; exact ALiBi beyond its capacity is one ``ValueError``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import tiny_model, token_ids  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.integrations.hf.static_cache import CHUNK, LiveKeyStaticCache  # noqa: E402


def _swap(model, mode: str):
    if mode == "plsh":  # short blocks: a reach well below the generated length
        return hf.use_positional_lsh(model, num_samples=4, seed=2, slopes=0.3)
    return hf.use_alibi(model, slopes=0.1, window=3.0 if mode == "window" else None)


def _padded(batch: int = 2, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    ids = token_ids(batch, length)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    ids[1, :3] = 0
    return ids, mask


def _generate(model, ids, mask, new: int, **kwargs):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_scores=True,
            return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("name", ["bloom", "llama", "qwen3"])
@pytest.mark.parametrize("mode", ["plsh", "exact", "window"])
def test_static_cache_decodes_as_the_dynamic_cache_and_as_no_cache(name, mode):
    model = tiny_model(name, dtype=torch.float64)
    swap = _swap(model, mode)
    ids, mask = _padded()
    new = 40
    static_tokens, static_scores = _generate(model, ids, mask, new, cache_implementation="static")
    dyn_tokens, dyn_scores = _generate(model, ids, mask, new)
    full_tokens, full_scores = _generate(model, ids, mask, new, use_cache=False)  # every step on the whole sequence
    assert torch.equal(static_tokens, dyn_tokens) and torch.equal(static_tokens, full_tokens)
    assert (static_scores - full_scores).abs().max() < 1e-10
    assert (static_scores - dyn_scores).abs().max() < 1e-10
    # The capacity: the whole length for exact ALiBi, the live window plus a chunk otherwise (keys were dropped).
    length = ids.shape[1] + new - 1  # (generate never caches the last token)
    caps = LiveKeyStaticCache(swap, max_cache_len=length).capacities()
    if mode == "exact":
        assert caps == [length, length]
    else:
        reaches = [swap.key_reach(i) for i in range(2)]
        assert caps == [min(length, r + CHUNK) for r in reaches] and min(caps) < length, (caps, reaches)


def test_static_cache_buffers_stay_in_place_and_hold_only_the_capacity():
    """A reused cache continues its sequence (the previous output as the prompt) in the same buffers, of the
    window plus a chunk, and decodes as a fresh dynamic cache on the whole sequence."""
    model = tiny_model("llama", dtype=torch.float64)
    swap = _swap(model, "window")
    ids, mask = _padded()
    cache = LiveKeyStaticCache(swap, max_cache_len=64)
    with torch.no_grad():
        first = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=cache)
        buffers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        mask2 = torch.cat([mask, torch.ones_like(first[:, ids.shape[1] :])], 1)
        second = model.generate(first, attention_mask=mask2, max_new_tokens=20, do_sample=False, cache=cache)
        fresh = model.generate(first, attention_mask=mask2, max_new_tokens=20, do_sample=False)
    assert torch.equal(second, fresh)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == buffers
    assert all(layer.keys.shape[-2] == 3 + CHUNK for layer in cache.layers)
    assert cache.get_seq_length() == second.shape[1] - 1


def test_exact_alibi_beyond_the_capacity_is_one_value_error_and_writes_nothing():
    model = tiny_model("bloom", dtype=torch.float64)
    swap = _swap(model, "exact")
    ids, mask = _padded()
    cache = LiveKeyStaticCache(swap, max_cache_len=ids.shape[1] + 3)
    with pytest.raises(ValueError, match=r"max_cache_len=15.*max_new_tokens"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache=cache)
    assert [layer.seen for layer in cache.layers] == [ids.shape[1] + 3] * 2  # the refused step wrote no layer
    with pytest.raises(ValueError, match="max_cache_len"):
        LiveKeyStaticCache(swap, max_cache_len=0)


def test_other_static_implementations_are_refused_and_restore_gives_back_the_stock_static_cache():
    model = tiny_model("llama")
    ids, mask = _padded()
    with torch.no_grad():
        stock = model.generate(ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static")
        swap = _swap(model, "exact")
        with pytest.raises(ValueError, match="offloaded_static"):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                           cache_implementation="offloaded_static")  # fmt: skip
        swap.restore()
        again = model.generate(ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static")
    assert "_prepare_static_cache" not in model.__dict__
    assert torch.equal(stock, again)


@pytest.mark.parametrize(("name", "mode", "backend"), [("bloom", "exact", "eager"), ("llama", "window", "aot_eager")])
def test_generate_under_torch_compile(name, mode, backend):
    """transformers compiles the decoding steps of a static-cache generate (``compile_config``; on CPU only when
    asked for every device): the same tokens as eager decoding."""
    torch._dynamo.reset()
    model = tiny_model(name)
    _swap(model, mode)
    ids, mask = _padded(length=16)
    config = transformers.CompileConfig(backend=backend, fullgraph=False, mode=None)
    config._compile_all_devices = True
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        compiled = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  cache_implementation="static", compile_config=config)  # fmt: skip
    assert hasattr(model, "_compiled_call")  # the decoding steps ran compiled
    assert torch.equal(eager, compiled)
    torch._dynamo.reset()


def test_a_layer_crops_while_it_holds_every_key_and_refuses_after_dropping():
    from positional_lsh.integrations.hf.static_cache import LiveKeyStaticLayer

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g)
    layer = LiveKeyStaticLayer(capacity=8, reach=None)
    layer.update(k[..., :5, :], v[..., :5, :])
    layer.crop(-2)  # transformers' convention: a negative count of tokens to remove
    keys, values = layer.update(k[..., 5:, :], v[..., 5:, :])
    assert layer.get_seq_length() == 4
    assert torch.equal(keys, torch.cat([k[..., :3, :], k[..., 5:, :]], -2))
    assert torch.equal(values, torch.cat([v[..., :3, :], v[..., 5:, :]], -2))
    windowed = LiveKeyStaticLayer(capacity=4, reach=2)
    windowed.update(k, v)  # 6 tokens into 4 slots: the first two dropped
    assert not windowed.is_croppable
    with pytest.raises(ValueError, match="cropped"):
        windowed.crop(-1)
