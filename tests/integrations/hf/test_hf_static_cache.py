"""``generate(..., cache_implementation="static")`` on a swapped model (issue 34, item 26): a fixed-capacity cache
(:class:`~positional_lsh.integrations.hf.static_cache.LiveKeyStaticCache`) that decodes as the default dynamic cache
and as decoding without a cache, under ``torch.compile`` too (``fullgraph=True``, no recompilation: the slot layout);
exact ALiBi beyond its capacity is one ``ValueError``."""

from __future__ import annotations

import io
import logging

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
    # The capacity, one for every layer (they share the slots' mask): the whole length for exact ALiBi, the
    # longest live window plus a chunk otherwise (keys were dropped).
    length = ids.shape[1] + new - 1  # (generate never caches the last token)
    caps = LiveKeyStaticCache(swap, max_cache_len=length).capacities()
    if mode == "exact":
        assert caps == [length, length]
    else:
        reaches = [swap.key_reach(i) for i in range(2)]
        assert caps == [max(reaches) + CHUNK] * 2 and caps[0] < length, (caps, reaches)


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


@pytest.mark.parametrize("name", ["bloom", "llama", "qwen3"])
@pytest.mark.parametrize("mode", ["plsh", "exact", "window"])
def test_compiled_generate_is_one_graph_without_recompilation(name, mode):
    """transformers' own check (``test_generate_compile_model_forward_fullgraph``): ``fullgraph=True``,
    ``dynamic=False``, two generations of 30 tokens (past the capacity: keys are dropped, except for exact ALiBi)
    with a left-padded row, and no ``Recompiling`` in dynamo's guard log; the eager tokens."""
    torch._dynamo.reset()
    model = tiny_model(name)
    _swap(model, mode)
    ids, mask = _padded(batch=4, length=12)
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    config._compile_all_devices = True
    halves = [(ids[i : i + 2], mask[i : i + 2]) for i in (0, 2)]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        eager = [model.generate(x, attention_mask=m, max_new_tokens=30, do_sample=False) for x, m in halves]
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    guards = logging.getLogger("torch._dynamo.guards")
    guards.addHandler(handler)
    torch._logging.set_logs(recompiles_verbose=True)
    try:
        with torch.no_grad():
            static = dict(max_new_tokens=30, do_sample=False, cache_implementation="static", compile_config=config)
            compiled = [model.generate(x, attention_mask=m, **static) for x, m in halves]
    finally:
        torch._logging.set_logs()
        guards.removeHandler(handler)
        torch._dynamo.reset()
    assert hasattr(model, "_compiled_call")
    assert "Recompiling" not in log.getvalue(), log.getvalue()[:3000]
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["falcon", "mpt"])
def test_falcon_and_mpt_static_caches_return_the_filled_part(name):
    """Falcon builds its ALiBi tensor from the mask and MPT casts it to bool: their static caches keep the layout
    of a dynamic cache (the filled part, a mask of the whole sequence), and decode as it."""
    model = tiny_model(name, dtype=torch.float64)
    swap = _swap(model, "window")
    ids, mask = _padded()
    static_tokens, static_scores = _generate(model, ids, mask, 20, cache_implementation="static")
    dyn_tokens, dyn_scores = _generate(model, ids, mask, 20)
    assert torch.equal(static_tokens, dyn_tokens) and (static_scores - dyn_scores).abs().max() < 1e-10
    assert not LiveKeyStaticCache(swap, max_cache_len=40).layers[0].slots


def test_static_cache_weights_are_the_slots_of_the_sequence_weights():
    """``output_attentions=True`` on a static cache: a step's weights over the buffer's slots, equal to the dynamic
    cache's weights over the sequence at the slots' positions (the empty slots 0), and ``weights @ v`` the output."""
    model = tiny_model("llama", dtype=torch.float64)
    swap = _swap(model, "window")
    ids, mask = _padded()
    cap = swap.key_reach(0) + CHUNK
    kwargs = dict(max_new_tokens=12, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        static = model.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)
        dynamic = model.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)
    for step in range(1, 12):
        n = ids.shape[1] + step  # the sequence's length at this step
        for layer in range(2):
            w_static, w_dyn = static.attentions[step][layer], dynamic.attentions[step][layer]
            assert w_static.shape[-1] == cap and w_dyn.shape[-1] == n
            expected = w_dyn[..., -cap:] if n >= cap else torch.nn.functional.pad(w_dyn, (cap - n, 0))
            torch.testing.assert_close(w_static, expected, rtol=0, atol=1e-12)


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
    keys, values = layer.update(k[..., 5:, :], v[..., 5:, :])  # one token: the whole buffer (the slot layout)
    assert layer.get_seq_length() == 4 and int(layer.length) == 4 and keys.shape[-2] == 8
    assert torch.equal(keys[..., 4:, :], torch.cat([k[..., :3, :], k[..., 5:, :]], -2))
    assert torch.equal(values[..., 4:, :], torch.cat([v[..., :3, :], v[..., 5:, :]], -2))
    assert not keys[..., :4, :].any()  # the empty slots
    with pytest.raises(ValueError, match="max_cache_len=4"):  # a reach beyond the capacity: it holds every key
        LiveKeyStaticLayer(capacity=4, reach=10).update(k, v)
    windowed = LiveKeyStaticLayer(capacity=4, reach=2, chunk=2)
    windowed.update(k, v)  # 6 tokens into 4 slots: the first two dropped
    assert not windowed.is_croppable
    with pytest.raises(ValueError, match="cropped"):
        windowed.crop(-1)


def test_a_step_whose_mask_does_not_cover_the_sequence_is_refused_and_writes_nothing():
    """Continuing a static cache, the 2-D padding mask must cover the whole sequence (as transformers asks): a mask
    of the new tokens only is one ``ValueError`` before any layer runs (the cache as it was)."""
    model = tiny_model("llama")
    swap = _swap(model, "window")
    ids, mask = _padded()
    cache = LiveKeyStaticCache(swap, max_cache_len=32)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
        before = [layer.keys.clone() for layer in cache.layers]
        with pytest.raises(ValueError, match=r"attention_mask must cover the whole sequence, \(2, 13\)"):
            model(ids[:, :1], attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 12
    assert all(torch.equal(layer.keys, b) for layer, b in zip(cache.layers, before, strict=True))


@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_beam_search_on_a_static_cache_equals_no_cache(name):
    """Beam search reorders the cache's buffers between steps: the slot layout follows (positional LSH, past the
    capacity, a left-padded row)."""
    model = tiny_model(name, dtype=torch.float64)
    _swap(model, "plsh")
    ids, mask = _padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=25, num_beams=3, do_sample=False)
    with torch.no_grad():
        static = model.generate(ids, cache_implementation="static", **kwargs)
        full = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(static, full)


@pytest.mark.parametrize("mode", ["plsh", "window"])
def test_a_right_padded_prompt_on_a_static_cache_equals_no_cache(mode):
    """A right-padded prompt becomes holes under generate: the slots' positions count them (as padding masks do),
    past the capacity too."""
    model = tiny_model("qwen3", dtype=torch.float64)
    _swap(model, mode)
    ids, mask = _padded()
    mask[0, -2:] = 0  # right padding in the first row: holes once tokens follow
    static_tokens, static_scores = _generate(model, ids, mask, 30, cache_implementation="static")
    full_tokens, full_scores = _generate(model, ids, mask, 30, use_cache=False)
    assert torch.equal(static_tokens, full_tokens)
    assert (static_scores - full_scores).abs().max() < 1e-10
