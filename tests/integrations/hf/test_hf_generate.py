"""Bounded generation by default (issue 33): after a bounded swap (positional LSH, windowed ALiBi) a plain
``generate`` holds the live keys only (LiveKeyCache) and prefills its prompt in chunks; restoring undoes it, the
user's explicit choices are kept, exact ALiBi keeps transformers' full cache. The chunked, bounded generation gives
the tokens (and scores) of the one-piece full-cache generation with the same partitions. A generated token reads,
builds and allocates nothing of the prompt's length (the swap's decoding loop keeps the ids in one buffer:
tests/integrations/hf/test_hf_generation_loop.py tests the loop itself)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import bounded_swap, tiny_model, token_ids  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.integrations.hf.cache import LiveKeyCache  # noqa: E402
from positional_lsh.integrations.hf.generation import PREFILL_CHUNK  # noqa: E402
from positional_lsh.integrations.hf.generation_loop import GrowingColumns  # noqa: E402


class _Calls:
    """Records the model calls of a generate: the query lengths they bring and the cache they get (a forward pre-hook
    on the base model)."""

    def __init__(self, model) -> None:
        self.lengths: list[int] = []
        self.cache = None
        self.handle = model.base_model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[-1]))
        self.cache = kwargs.get("cache")


def _generate(model, x, tokens: int = 4, **kwargs):
    """Greedy tokens, scores, and the cache the model calls got (``use_cache=True``: MPT's config turns it off)."""
    kwargs.setdefault("use_cache", True)
    calls = _Calls(model)
    try:
        out = model.generate(
            x, max_new_tokens=tokens, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs
        )
    finally:
        calls.handle.remove()
    return out.sequences, torch.stack(out.scores), calls.cache


@pytest.mark.parametrize("mode", ["plsh", "window"])
def test_a_bounded_swap_sets_the_generation_defaults_and_restoring_undoes_them(mode):
    model = tiny_model("bloom")
    x = token_ids(batch=1, length=40)
    assert model.generation_config.prefill_chunk_size is None
    with bounded_swap(model, mode):
        assert model.generation_config.prefill_chunk_size == PREFILL_CHUNK
        _, _, cache = _generate(model, x)
        assert isinstance(cache, LiveKeyCache)
        calls = _Calls(model)
        _, _, cache = _generate(model, x, prefill_chunk_size=16)  # a generate argument wins
        calls.handle.remove()
        assert calls.lengths == [16, 16, 8, 1, 1, 1] and isinstance(cache, LiveKeyCache)
        assert max(cache.cached_tokens()) < 40  # dead keys dropped
        seq, _, used = _generate(model, x, use_cache=False)  # no cache: one piece (transformers chunks only a cache)
        assert used is None and torch.equal(seq, _generate(model, x)[0])
    assert model.generation_config.prefill_chunk_size is None
    assert "_prepare_cache_for_generation" not in model.__dict__
    assert "_update_model_kwargs_for_generation" not in model.__dict__
    _, _, cache = _generate(model, x)
    assert type(cache) is transformers.DynamicCache


def test_explicit_choices_are_kept():
    model = tiny_model("qwen3")
    x = token_ids(batch=1, length=40)
    model.generation_config.prefill_chunk_size = 8
    with bounded_swap(model, "plsh"):
        assert model.generation_config.prefill_chunk_size == 8  # the user's, before the swap
        calls = _Calls(model)
        _generate(model, x, tokens=2)
        _generate(model, x, tokens=2, prefill_chunk_size=None)  # one piece, asked for
        calls.handle.remove()
        assert calls.lengths == [8] * 5 + [1] + [40, 1]
        for cache in (transformers.DynamicCache(config=model.config), None):
            kwargs = {"cache": cache} if cache is not None else {"cache_implementation": "dynamic"}
            _, _, used = _generate(model, x, **kwargs)
            assert type(used) is transformers.DynamicCache and (cache is None or used is cache)
    assert model.generation_config.prefill_chunk_size == 8


def test_exact_alibi_keeps_the_full_cache_also_stacked_on_a_bounded_swap():
    model = tiny_model("mpt")
    x = token_ids(batch=1, length=40)
    with bounded_swap(model, "exact"):
        assert model.generation_config.prefill_chunk_size is None
        assert type(_generate(model, x)[2]) is transformers.DynamicCache
    with bounded_swap(model, "plsh"):
        with bounded_swap(model, "exact"):
            assert model.generation_config.prefill_chunk_size is None
            assert type(_generate(model, x)[2]) is transformers.DynamicCache
        assert model.generation_config.prefill_chunk_size == PREFILL_CHUNK  # the bounded swap's, back
        assert isinstance(_generate(model, x)[2], LiveKeyCache)
    assert model.generation_config.prefill_chunk_size is None


def test_a_saved_swapped_model_writes_its_generation_config_as_before_and_copies_keep_the_defaults(tmp_path):
    model = tiny_model("llama")
    swap = bounded_swap(model, "window")
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert "prefill_chunk_size" not in saved or saved["prefill_chunk_size"] is None
    assert model.generation_config.prefill_chunk_size == PREFILL_CHUNK
    twin = copy.deepcopy(model)
    assert twin.generation_config.prefill_chunk_size == PREFILL_CHUNK
    hf.restore(twin)
    assert twin.generation_config.prefill_chunk_size is None
    assert model.generation_config.prefill_chunk_size == PREFILL_CHUNK
    swap.restore()
    assert model.generation_config.prefill_chunk_size is None


@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("name", ["bloom", "falcon", "mpt", "llama", "qwen3"])
def test_chunked_bounded_generation_is_the_one_piece_full_cache_generation(name, mode):
    # float64; the prompt longer than the keys a query reaches (plsh: about 35, the window: 6), so dead keys are
    # dropped between chunks; chunks of 24 (the first on the full op, the later ones on the decoding kernels over the
    # live keys) and of 5. Row 1 left-padded.
    model = tiny_model(name, dtype=torch.float64)
    x = token_ids(batch=2, length=100)
    mask = torch.ones_like(x)
    x[1, :7], mask[1, :7] = 0, 0
    with bounded_swap(model, mode):
        full = transformers.DynamicCache(config=model.config)
        seq, scores, _ = _generate(model, x, 12, attention_mask=mask, cache=full, prefill_chunk_size=None)
        assert full.get_seq_length() == 111 and full.layers[0].keys.shape[-2] == 111
        for chunk in (24, 5):
            b_seq, b_scores, cache = _generate(model, x, 12, attention_mask=mask, prefill_chunk_size=chunk)
            assert isinstance(cache, LiveKeyCache) and max(cache.cached_tokens()) < 50
            assert torch.equal(b_seq, seq)
            torch.testing.assert_close(b_scores, scores, rtol=0, atol=1e-10)
        b_seq, _, _ = _generate(model, x[:1], 12)  # the defaults: one chunk here, bounded cache
        assert torch.equal(b_seq, seq[:1])


class _Elements(TorchDispatchMode):
    """The floating-point and bool elements the aten ops read and write (views excepted), and the largest tensor they
    read or write."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            read = () if func.__name__.startswith("new_") else (args, kwargs or {})  # (new_empty reads no element)
            for x in tree_flatten((read, out))[0]:
                if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.dtype == torch.bool):
                    self.elements += x.numel()
                    self.largest = max(self.largest, x.numel())
        return out


class _CountAfterPrefill:
    """A generate streamer that counts the work of the generated tokens after the first (the prefill's is not), with
    ``work`` (a dispatch mode; default :class:`_Elements`)."""

    def __init__(self, work: TorchDispatchMode | None = None) -> None:
        self.work = work if work is not None else _Elements()
        self.puts = 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.work.__enter__()

    def end(self) -> None:
        self.work.__exit__(None, None, None)


@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("name", ["bloom", "qwen3"])
def test_a_generated_token_reads_and_builds_nothing_of_the_prompt_length(name, mode):
    # A plain generate after the swap: the work of the generated tokens (floating-point and bool elements read and
    # written, the whole model) and its largest tensor do not grow with the prompt (before: BLOOM's (B H, 1, n) ALiBi
    # tensor and (B, n) masks per token, Qwen3's (B, n) position ids grown per token).
    model = tiny_model(name)
    runs = {}
    with bounded_swap(model, mode):
        for n in (256, 4096):
            count = _CountAfterPrefill()
            model.generate(token_ids(batch=1, length=n), max_new_tokens=6, do_sample=False, streamer=count)
            runs[n] = count.work
    assert runs[4096].elements < 1.25 * runs[256].elements, {n: w.elements for n, w in runs.items()}
    assert runs[4096].largest <= max(runs[256].largest, 4096 // 4), {n: w.largest for n, w in runs.items()}


class _Allocations(TorchDispatchMode):
    """The largest tensor any aten op creates (views excepted), every dtype: the int64 ids included."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func.overloadpacket.__name__.endswith("_"):  # (in-place: into what exists)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("name", ["bloom", "qwen3"])
def test_a_decoding_step_allocates_nothing_of_the_prompt_length(name, monkeypatch):
    # Every tensor an aten op creates during the steps after the first token (ids, masks, logits, keys, the decode
    # plan's rebuilds, any dtype) is smaller than the prompt (anything of the prompt's length has n elements or
    # more); transformers' loop creates the (1, n + t) ids per token (torch.cat), which the same count sees. The ids
    # buffer is allocated once: the sequences returned are it, at its capacity.
    model = tiny_model(name)
    buffers = []
    init = GrowingColumns.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        buffers.append(self)

    monkeypatch.setattr(GrowingColumns, "__init__", recorded)
    n = 8192
    x = token_ids(batch=1, length=n)
    with bounded_swap(model, "plsh"):
        ours, stock = _CountAfterPrefill(_Allocations()), _CountAfterPrefill(_Allocations())
        out = model.generate(x, max_new_tokens=6, do_sample=False, streamer=ours)
        type(model).generate(model, x, max_new_tokens=6, do_sample=False, streamer=stock)
    assert ours.puts == stock.puts == 7
    assert stock.work.largest >= n, stock.work.largest  # (the count sees the stock loop's O(n) ids)
    assert ours.work.largest < n, ours.work.largest
    assert len(buffers) == 1 and buffers[0].capacity == n + 6 and out.data_ptr() == buffers[0].buffer.data_ptr()


class _Positions:
    """The ``position_ids`` each model call of a generate gets (a forward pre-hook on the base model)."""

    def __init__(self, model) -> None:
        self.seen: list[torch.Tensor | None] = []
        self.handle = model.base_model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs) -> None:
        self.seen.append(kwargs.get("position_ids"))


@pytest.mark.parametrize("mode", ["plsh", "window"])
def test_a_generate_continuing_a_cache_grows_no_position_ids(mode):
    # A generate that continues a LiveKeyCache passed to it gets transformers' (B, n) position ids for its prompt;
    # the generated tokens get none (before: the ids grown by one column per token, an O(n) copy each), and decode
    # the same tokens as one generate over the whole sequence with the full cache.
    model = tiny_model("qwen3")
    x = token_ids(batch=1, length=48)
    with bounded_swap(model, mode) as swap:
        cache = swap.new_cache()
        first = model.generate(x[:, :30], max_new_tokens=3, do_sample=False, cache=cache)
        prompt = torch.cat([first, x[:, 33:]], dim=-1)
        held = cache.get_seq_length()  # (the first generate's last token is not in it yet)
        positions = _Positions(model)
        try:
            out = model.generate(prompt, max_new_tokens=5, do_sample=False, cache=cache, prefill_chunk_size=None)
        finally:
            positions.handle.remove()
        assert positions.seen[0] is not None and positions.seen[0].shape[-1] == prompt.shape[1] - held
        assert all(p is None for p in positions.seen[1:]), [None if p is None else p.shape for p in positions.seen]
        full = model.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="dynamic")
    assert torch.equal(out, full)


@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_generate_from_inputs_embeds_is_the_generate_from_ids(name, mode):
    """A prompt given as ``inputs_embeds`` (found by transformers' ``test_generate_from_inputs_embeds`` and
    ``test_generate_continue_from_inputs_embeds``): transformers' chunked prefill splits the ids only, so the swap's
    default chunk size cut a padded prompt's mask to no column (``ValueError``), and a generate continuing a cache
    from ``inputs_embeds`` fed its whole prompt again (19 keys for 10). The default is taken off for such a call:
    the tokens and scores of the same generate from the ids (greedy and beam search, a right-padded row), and a
    continued generate gives the tokens and the cache of one generate."""
    model = tiny_model(name, dtype=torch.float64)
    bounded_swap(model, mode)
    ids = token_ids(length=7)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    embeds = model.get_input_embeddings()(ids)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    for beams in (1, 2):
        with torch.no_grad():
            from_ids = model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, **kwargs)
            from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, num_beams=beams, **kwargs)
        assert torch.equal(from_embeds.sequences, from_ids.sequences[:, ids.shape[1] :])
        for a, b in zip(from_ids.scores, from_embeds.scores, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = -1
    greedy = dict(do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        whole = model.generate(inputs_embeds=embeds, max_new_tokens=4, **greedy)
        first = model.generate(inputs_embeds=embeds, max_new_tokens=3, **greedy)
        more = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], dim=1)
        rest = model.generate(inputs_embeds=more, max_new_tokens=1, cache=first.past_key_values, **greedy)
    assert torch.equal(whole.sequences, torch.cat([first.sequences, rest.sequences], dim=1))
    assert whole.past_key_values.get_seq_length() == rest.past_key_values.get_seq_length() == 10
    for a, b in zip(whole.past_key_values.layers, rest.past_key_values.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-12)
