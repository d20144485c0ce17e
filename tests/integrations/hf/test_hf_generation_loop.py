"""A bounded swap's decoding loop (issue 33's flat cost per token): ``model.generate`` after the swap runs
``DecodeLoop`` for greedy search and sampling, which gives transformers' own loop's tokens and scores (the same cache,
the same partitions: ``type(model).generate`` is the stock ``generate``), keeps the ids in a buffer that is never
reallocated, and hands everything it does not take to transformers' loop."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import bounded_swap, tiny_model, token_ids  # noqa: E402

from positional_lsh.integrations.hf.cache import LiveKeyCache  # noqa: E402
from positional_lsh.integrations.hf.generation_loop import BoundedGenerate, DecodeLoop, GrowingColumns  # noqa: E402


@pytest.fixture
def loops(monkeypatch):
    """The number of generate calls whose tokens ``DecodeLoop`` decoded (a list: one entry per call)."""
    seen: list[int] = []
    decode = DecodeLoop.decode

    def counted(self, *args, **kwargs):
        seen.append(1)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(DecodeLoop, "decode", counted)
    return seen


def _both(model, x, **kwargs):
    """The swapped model's generate (our loop) and transformers' stock generate (its loop), same arguments; a
    sampling call gets the same seed before each."""
    out = []
    for generate in (model.generate, lambda *a, **k: type(model).generate(model, *a, **k)):
        torch.manual_seed(11)
        out.append(generate(x, **kwargs))
    return out


def _padded(batch: int = 2, length: int = 60):
    x = token_ids(batch=batch, length=length)
    mask = torch.ones_like(x)
    x[1, :7], mask[1, :7] = 0, 0
    return x, mask


def _same(ours, stock) -> None:
    assert torch.equal(ours.sequences, stock.sequences)
    assert len(ours.scores) == len(stock.scores)
    for a, b in zip(ours.scores, stock.scores, strict=True):
        assert torch.equal(a, b)
    assert isinstance(ours.cache, LiveKeyCache) and isinstance(stock.cache, LiveKeyCache)


@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("name", ["bloom", "falcon", "mpt", "llama", "qwen3"])
def test_the_loop_gives_the_stock_loops_tokens_and_scores(name, mode, loops):
    # float64, a left-padded row, a chunked prefill that drops keys between chunks; greedy with scores and logits,
    # then seeded sampling with temperature, top-k and top-p (transformers' logits processors).
    model = tiny_model(name, dtype=torch.float64)
    x, mask = _padded()
    common = dict(attention_mask=mask, max_new_tokens=9, use_cache=True, prefill_chunk_size=16)
    common |= dict(return_dict_in_generate=True, output_scores=True)
    with bounded_swap(model, mode):
        ours, stock = _both(model, x, do_sample=False, output_logits=True, **common)
        _same(ours, stock)
        assert all(torch.equal(a, b) for a, b in zip(ours.logits, stock.logits, strict=True))
        assert ours.sequences.shape == (2, 69) and ours.sequences.is_contiguous()
        ours, stock = _both(model, x, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, **common)
        _same(ours, stock)
    assert len(loops) == 2


def test_eos_stop_streamer_hidden_states_and_a_batch_without_mask(loops):
    model = tiny_model("qwen3", dtype=torch.float64)
    x, mask = _padded()
    with bounded_swap(model, "plsh"):
        greedy = model.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False)
        eos = int(greedy[0, 63])  # row 0's fourth generated token: it stops there, row 1 is padded after its end
        streams = []
        outs = []
        for generate in (model.generate, lambda *a, **k: type(model).generate(model, *a, **k)):
            streamer = _Recorder()
            kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, streamer=streamer)
            kwargs |= dict(return_dict_in_generate=True, output_scores=True, output_hidden_states=True)
            outs.append(generate(x, **kwargs))
            streams.append(streamer)
        ours, stock = outs
        _same(ours, stock)
        assert int(ours.sequences[0, 63]) == eos and bool((ours.sequences[0, 64:] == 0).all())  # then pad (0)
        assert [t.tolist() for t in streams[0].puts] == [t.tolist() for t in streams[1].puts]
        assert streams[0].ended == streams[1].ended == 1
        for a, b in zip(ours.hidden_states, stock.hidden_states, strict=True):
            assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
        one, stock_one = _both(model, x[:1], max_new_tokens=5, do_sample=False)  # no mask at all
        assert torch.equal(one, stock_one) and one.shape == (1, 65)
    assert len(loops) == 3


class _Recorder:
    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


def test_the_swap_installs_the_loop_and_restoring_undoes_it(loops):
    model = tiny_model("bloom")
    x = token_ids(batch=1, length=40)
    assert "generate" not in model.__dict__
    with bounded_swap(model, "window") as swap:
        assert isinstance(model.__dict__["generate"], BoundedGenerate) and model.generate.swap is swap
        with bounded_swap(model, "exact"):  # exact ALiBi: unbounded, transformers' loop while it is in effect
            assert "generate" not in model.__dict__
            model.generate(x, max_new_tokens=3, do_sample=False)
            assert not loops
        assert model.generate.swap is swap
        with bounded_swap(model, "plsh") as top:  # a bounded swap on top: its own loop, then the one below's again
            assert model.generate.swap is top
            model.generate(x, max_new_tokens=3, do_sample=False)
        assert model.generate.swap is swap and len(loops) == 1
    assert "generate" not in model.__dict__
    model.generate(x, max_new_tokens=3, do_sample=False)
    assert len(loops) == 1

    def own(*args, **kwargs):  # a generate of the instance's own (a Hub repository's custom_generate) is kept
        return "own"

    model.__dict__["generate"] = own
    with bounded_swap(model, "plsh"):
        assert model.generate(x) == "own"
    assert model.__dict__["generate"] is own


def test_what_the_loop_does_not_take_goes_to_transformers_loop_unchanged(loops):
    model = tiny_model("llama")
    x = token_ids(batch=1, length=30)
    greedy = dict(max_new_tokens=4, do_sample=False)
    with bounded_swap(model, "plsh") as swap:
        for kwargs in (
            lambda: dict(num_beams=2),  # beam search
            lambda: dict(cache=transformers.DynamicCache(config=model.config)),  # a cache of the user's
            lambda: dict(cache_implementation="dynamic"),
            lambda: dict(use_cache=False),
            lambda: dict(prompt_lookup_num_tokens=2),  # assisted decoding
        ):
            ours = model.generate(x, **greedy, **kwargs())
            assert torch.equal(ours, type(model).generate(model, x, **greedy, **kwargs())), kwargs()
        assert not loops
        called = []

        def custom(model, input_ids, **kwargs):  # a custom_generate of the user's is called
            called.append(input_ids.shape)
            return input_ids

        assert torch.equal(model.generate(x, custom_generate=custom, **greedy), x) and called == [(1, 30)]
        # The user's own choices the loop does take: repetition penalty (an O(n) processor), a minimum length, a
        # generation config passed positionally, a LiveKeyCache passed in.
        ours, stock = _both(model, x, **greedy, repetition_penalty=1.3, min_new_tokens=3)
        assert torch.equal(ours, stock)
        ours = model.generate(x, **greedy, cache=swap.new_cache())
        assert torch.equal(ours, type(model).generate(model, x, **greedy, cache=swap.new_cache()))
        config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(x, config), type(model).generate(model, x, config))
        assert len(loops) == 3


def test_growing_columns_double_and_keep_what_they_hold():
    start = torch.arange(6).reshape(2, 3)
    cols = GrowingColumns(start, 4)
    for k in range(5):
        cols.append(torch.tensor([10 + k, 20 + k]))
    assert cols.capacity == 8 and cols.length == 8
    assert cols.view().tolist() == [[0, 1, 2, 10, 11, 12, 13, 14], [3, 4, 5, 20, 21, 22, 23, 24]]
    assert cols.result() is cols.buffer
    ones = GrowingColumns(torch.tensor([[0, 1]]), None, fill=1)
    ones.append(None)
    assert ones.capacity == 3 and ones.result().tolist() == [[0, 1, 1]]
    ones.append(None)
    assert ones.capacity == 6 and ones.result().tolist() == [[0, 1, 1, 1]] and ones.result().shape == (1, 4)
