"""Fast decoding (issue 18, failure F), tested as a mechanism, counted rather than timed: the work of a decoded token
does not grow with the prompt, nor with the number of samples T (no per-call plan over every block of every sample);
LiveKeyCache holds only the keys a later query can reach and decodes exactly as the default DynamicCache.
Speed and memory: benchmarks/hf_decode.py (figures in docs/hf.md)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MODEL_TYPES, tiny_model, token_ids  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.integrations.hf import attention_swap  # noqa: E402


class _Work(TorchDispatchMode):
    """Counts the aten ops run and the floating-point elements they read (the tensor inputs of every op that is not a
    view: slicing the cache reads nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.is_view:
            return func(*args, **(kwargs or {}))
        for x in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                self.elements += x.numel()
        return func(*args, **(kwargs or {}))


def _decode_work(
    prompt: int, num_samples: int, *, live: bool, attention_only: bool, monkeypatch, tokens: int = 1
) -> tuple:
    """Work of ``tokens`` decoded tokens after ``prompt`` tokens: (ops, elements) of the attention calls or of the
    model."""
    model = tiny_model("llama")
    swap = hf.use_positional_lsh(model, num_samples=num_samples, seed=0, slopes=0.1)
    work = _Work()
    counting = {"on": False}
    if attention_only:
        original = attention_swap.AttentionSwap.attend

        def counted(self, *args, **kwargs):
            if not counting["on"]:
                return original(self, *args, **kwargs)
            with work:
                return original(self, *args, **kwargs)

        monkeypatch.setattr(attention_swap.AttentionSwap, "attend", counted)
    cache = swap.new_cache() if live else transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(token_ids(batch=1, length=prompt), cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        model(token, cache=cache, use_cache=True)  # the first decoded token (a LiveKeyCache drops its dead keys)
        counting["on"] = True
        for _ in range(tokens):
            if attention_only:
                model(token, cache=cache, use_cache=True)
            else:
                with work:
                    model(token, cache=cache, use_cache=True)
    monkeypatch.undo()
    return work.ops, work.elements, cache, swap


def test_attention_work_per_decoded_token_does_not_grow_with_the_prompt_or_t(monkeypatch):
    # With the default DynamicCache: the attention of a decoded token reads its blocks' keys and a constant amount
    # more. Before, it planned every block of every sample (ops ~ T H) and scanned all n keys for non-finite values.
    # Over 8 tokens: the decoding plan rebuilds its bias row when a token crosses a block boundary (more often with
    # more samples), so a token's ops depend on where it is, not on the prompt's length.
    runs = {
        (n, t): _decode_work(n, t, live=False, attention_only=True, monkeypatch=monkeypatch, tokens=8)
        for n in (128, 2048)
        for t in (4, 16)
    }
    ops = {key: r[0] for key, r in runs.items()}
    elements = {key: r[1] for key, r in runs.items()}
    for t in (4, 16):
        assert ops[(2048, t)] < 1.2 * ops[(128, t)] and ops[(128, t)] < 1.2 * ops[(2048, t)], ops
        # 16x the keys; the span of a token's blocks depends on its position only (slope 0.1: about 60 keys).
        assert elements[(2048, t)] < 1.5 * elements[(128, t)], elements
    assert ops[(2048, 16)] < 2 * ops[(2048, 4)], ops
    reach = runs[(2048, 4)][3].key_reach(0)
    heads, head_dim, layers = 4, 8, 2
    assert elements[(2048, 4)] < 8 * layers * 8 * heads * (reach + 1) * head_dim  # a few passes over its span, not n


def test_live_key_cache_bounds_memory_and_the_work_of_the_whole_model(monkeypatch):
    # Over 8 tokens: the decoding plan rebuilds its bias row when a token crosses a block boundary, so one token's
    # ops depend on where it is; their sum over a few tokens does not grow with the prompt.
    runs = {
        n: _decode_work(n, 4, live=True, attention_only=False, monkeypatch=monkeypatch, tokens=8) for n in (128, 2048)
    }
    (ops_a, el_a, cache_a, swap), (ops_b, el_b, cache_b, _) = runs[128], runs[2048]
    assert ops_b < 1.2 * ops_a and ops_a < 1.2 * ops_b, (ops_a, ops_b)
    assert el_b < 1.25 * el_a  # the whole model's work per token: flat (the default cache copies all n keys)
    for cache in (cache_a, cache_b):
        held = cache.cached_tokens()
        assert all(h <= swap.key_reach(i) + 1 for i, h in enumerate(held)), held
    assert cache_b.memory_bytes() <= 1.5 * cache_a.memory_bytes()
    _, el_dynamic, dynamic, _ = _decode_work(
        2048, 4, live=False, attention_only=False, monkeypatch=monkeypatch, tokens=8
    )
    assert el_dynamic > 2 * el_b  # (the default DynamicCache copies its 2048 keys for every new token)
    assert dynamic.get_seq_length() == cache_b.get_seq_length() == 2057


def _generate(model, x, mask, cache, tokens: int = 10):
    out = model.generate(
        x,
        attention_mask=mask,
        max_new_tokens=tokens,
        do_sample=False,
        use_cache=True,
        cache=cache,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("name", MODEL_TYPES)
def test_live_key_cache_generates_as_the_default_cache(name, mode):
    model = tiny_model(name, dtype=torch.float64)
    x = token_ids(length=40)
    mask = torch.ones_like(x)
    x[1, :6], mask[1, :6] = 0, 0  # a left-padded row: its positions count from its first valid token
    if mode == "plsh":
        swap = hf.use_positional_lsh(model, num_samples=4, seed=1, slopes=0.3)
    else:
        swap = hf.use_alibi(model, window=5.0)
    with swap:
        seq, scores = _generate(model, x, mask, transformers.DynamicCache(config=model.config))
        cache = swap.new_cache()
        assert type(cache).__name__ == "LiveKeyCache"
        live_seq, live_scores = _generate(model, x, mask, cache)
    assert torch.equal(live_seq, seq)
    torch.testing.assert_close(live_scores, scores, rtol=0, atol=1e-12)
    held, offsets = cache.cached_tokens(), [layer.offset for layer in cache.layers]
    assert all(0 < o for o in offsets) and all(h + o == 49 for h, o in zip(held, offsets, strict=True))


def test_exact_alibi_keeps_every_key_and_refusals():
    model = tiny_model("qwen3", dtype=torch.float64)
    x = token_ids(batch=1, length=30)
    with hf.use_alibi(model) as exact:
        cache = exact.new_cache()
        model.generate(x, max_new_tokens=3, do_sample=False, cache=cache)
        assert cache.cached_tokens() == [32, 32]  # no key is ever dead for exact ALiBi
    with hf.use_alibi(model, window=4.0) as windowed:
        cache = windowed.new_cache()
        model.generate(x, max_new_tokens=3, do_sample=False, cache=cache)
        assert cache.cached_tokens() == [5, 5]
        with pytest.raises(ValueError, match="cropped"):
            cache.crop(-1)
    with hf.use_alibi(model):  # the same (trimmed) cache with an attention that needs every key
        with pytest.raises(ValueError, match="dropped keys"):
            model(x[:, -1:], cache=cache, use_cache=True)
    with hf.use_positional_lsh(model, num_samples=4, slopes=0.01) as wide:  # longer blocks than the window kept
        with pytest.raises(ValueError, match="dropped"):
            model(x[:, -1:], cache=cache, use_cache=True)
        assert wide.key_reach(0) > 4


@pytest.mark.parametrize("mode", ["plsh", "alibi", "window"])
@pytest.mark.parametrize("name", MODEL_TYPES)
def test_the_decoding_plan_generates_as_the_default_cache(name, mode):
    # Unpadded rows: each decoded token runs the KV-cache entry point with the cache layer's DecodeState (its bias
    # row reused across tokens, the new key written into the cache's buffers); the default cache runs it with the
    # swap's own state, on every key. Long enough for the row to cross many block boundaries and for the buffers
    # to move.
    from positional_lsh.ops.kvcache import DecodeState

    model = tiny_model(name, dtype=torch.float64)
    for batch in (1, 2):
        x = token_ids(batch=batch, length=24)
        if mode == "plsh":
            swap = hf.use_positional_lsh(model, num_samples=4, seed=2, slopes=0.2)
        else:
            swap = hf.use_alibi(model, slopes=0.1, window=6.0 if mode == "window" else None)
        with swap:
            seq, scores = _generate(model, x, None, transformers.DynamicCache(config=model.config), tokens=30)
            cache = swap.new_cache()
            live_seq, live_scores = _generate(model, x, None, cache, tokens=30)
        assert torch.equal(live_seq, seq)
        torch.testing.assert_close(live_scores, scores, rtol=0, atol=1e-12)
        for layer in cache.layers:
            assert isinstance(layer.decode_state, DecodeState)
            keys, _ = layer.held_tensors()
            assert keys is not layer.keys and keys.shape[-2] >= layer.cached_length()  # a view of its buffer


def test_live_key_layer_buffers_nonfinite_keys_and_autograd():
    model = tiny_model("llama", dtype=torch.float64)
    swap = hf.use_positional_lsh(model, num_samples=4, seed=0, slopes=0.3)
    layer = swap.new_cache().layers[0]
    kv = [torch.randn(1, 2, m, 8, dtype=torch.float64) for m in (5, 1, 1, 1)]
    with torch.no_grad():
        layer.update(kv[0], kv[0] + 1)
        assert layer.keys_finite()
        bad = kv[1].clone()
        bad[0, 1, 0, 3] = float("inf")
        layer.update(bad, kv[1])
        assert not layer.keys_finite() and layer.nonfinite_end == 6
        layer.update(kv[2], kv[2])
    # The cached keys are exactly the appended ones, in order, whatever the buffers did.
    want = torch.cat([kv[0], bad, kv[2]], dim=-2)[..., layer.offset :, :]
    assert torch.equal(layer.keys, want)
    # With autograd on, a token is concatenated (the views autograd saved stay valid); then buffers again.
    x = kv[3].clone().requires_grad_()
    keys, _ = layer.update(x, x)
    keys.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with torch.no_grad():
        keys, _ = layer.update(kv[1], kv[1])
    assert torch.equal(keys[..., -2:, :], torch.cat([kv[3], kv[1]], dim=-2))
    # Replaced tensors (as a beam reorder replaces them) become the buffers' contents.
    layer.keys, layer.values = layer.keys.flip(-1), layer.values.flip(-1)
    before = layer.keys
    with torch.no_grad():
        keys, _ = layer.update(kv[2], kv[2])
    assert torch.equal(keys[..., :-1, :], before) and torch.equal(keys[..., -1:, :], kv[2])
    # Inference-mode buffers, then a token outside inference mode (buffers that cannot be written in place).
    layer = swap.new_cache().layers[0]
    with torch.inference_mode():
        layer.update(kv[0], kv[0])
    with torch.no_grad():
        keys, _ = layer.update(kv[1], kv[1])
    assert torch.equal(keys, torch.cat([kv[0], kv[1]], dim=-2)[..., layer.offset :, :])


def test_the_all_valid_mask_is_read_once_per_mask_and_version():
    from positional_lsh.integrations.hf.masks import padding_mask_interface

    model = tiny_model("llama")
    swap = hf.use_positional_lsh(model, num_samples=2, seed=0)
    mask = torch.ones(2, 9, dtype=torch.bool)
    assert swap._all_valid(mask) and swap._all_valid(mask)
    mask[1, 0] = False  # changed in place: read again
    assert not swap._all_valid(mask)
    assert not swap._all_valid(mask)
    mask[1, 0] = True
    assert swap._all_valid(mask)
    with torch.inference_mode():  # the all-valid mask of a call without one: never an inference tensor
        none = padding_mask_interface(2, 1, 9, q_offset=8, attention_mask=None)
    assert none.shape == (2, 9) and bool(none.all()) and not none.is_inference()


def test_the_neutral_rotary_embedding_of_a_decoded_token_is_reused():
    model = tiny_model("qwen3")
    rotary = model.model.rotary_emb
    with hf.use_positional_lsh(model, num_samples=2, seed=0):
        x = torch.randn(2, 1, 32)
        first = rotary(x, torch.tensor([[7], [9]]))
        again = rotary(x, torch.tensor([[8], [10]]))  # the next token: the same ones and zeros
        assert again[0] is first[0] and again[1] is first[1]
        assert torch.equal(first[0], torch.ones(2, 1, 8)) and torch.equal(first[1], torch.zeros(2, 1, 8))
        one_row = rotary(x[:1], torch.tensor([[7]]))  # another shape, dtype or mode: made anew
        assert one_row[0].shape == (1, 1, 8) and one_row[0] is not first[0]
        with torch.inference_mode():
            inside = rotary(x[:1], torch.tensor([[7]]))
        assert inside[0] is not one_row[0] and inside[0].is_inference()
        prompt = rotary(x.expand(2, 5, 32), torch.arange(5).expand(2, 5))  # several positions: not held
        assert prompt[0].shape == (2, 5, 8) and bool((prompt[0] == 1).all()) and bool((prompt[1] == 0).all())
