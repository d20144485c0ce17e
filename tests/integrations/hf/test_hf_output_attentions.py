"""``output_attentions=True`` on swapped models: the weights each layer's call used, checked against float64
computations written here (exact ALiBi ``softmax(s - m |i - j|)``; positional LSH ``softmax(s + log Mbar)`` from the
swap's partitions' ``mean_mask()``), against the call's own output (weights @ v, and the op's output for the same
call), and against transformers' own eager weights where the stock model computes the same ALiBi (BLOOM, MPT). With
the weights asked for, the output is computed from them: ``retain_grad()`` on them gets a gradient, and the
model's outputs and gradients equal those of the call without the weights (float64)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import tiny_model, token_ids  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.ops.exact import weights as weights_module  # noqa: E402

FAMILIES = ("bloom", "falcon", "mpt", "llama", "qwen3")


def _record(swap: Any) -> list[dict[str, Any]]:
    """Record every attention call of ``swap`` (its inputs and output; with the weights asked for, also the op's
    output for the same call, ``op``) by wrapping the instance's ``attend`` and ``attend_with_weights``."""
    calls: list[dict[str, Any]] = []
    attend, with_weights = swap.attend, swap.attend_with_weights

    def wrapped(layer_idx, training, q, k, v, key_valid, scale):  # type: ignore[no-untyped-def]
        out = attend(layer_idx, training, q, k, v, key_valid, scale)
        calls.append(dict(layer=layer_idx, q=q, k=k, v=v, valid=key_valid, scale=scale, out=out, op=out))
        return out

    def wrapped_weights(layer_idx, training, q, k, v, key_valid, scale):  # type: ignore[no-untyped-def]
        out, weights = with_weights(layer_idx, training, q, k, v, key_valid, scale)
        with torch.no_grad():
            op = attend(layer_idx, training, q, k, v, key_valid, scale)
        calls.append(dict(layer=layer_idx, q=q, k=k, v=v, valid=key_valid, scale=scale, out=out, op=op))
        return out, weights

    swap.attend, swap.attend_with_weights = wrapped, wrapped_weights
    return calls


def _oracle(swap: Any, call: dict[str, Any]) -> torch.Tensor:
    """float64 ``softmax(s + bias)`` of one recorded call, row by row on each row's valid keys (positions counted
    from its first valid key); padded keys and padded query rows 0."""
    q, k = call["q"].double(), call["k"].double()
    b, hq, lq, _ = q.shape
    lk = k.shape[-2]
    valid = call["valid"] if call["valid"] is not None else torch.ones(b, lk, dtype=torch.bool)
    assert valid.shape[-1] == lk  # no dropped keys in these calls
    kk = k.repeat_interleave(hq // k.shape[1], dim=1)
    s = q @ kk.transpose(-1, -2) * call["scale"]
    out = torch.zeros(b, hq, lq, lk, dtype=torch.float64)
    for r in range(b):
        idx = torch.nonzero(valid[r]).flatten()
        first, end = int(idx[0]), int(idx[-1]) + 1
        n = end - first
        qpos = torch.arange(lk - lq, lk)
        rows = (qpos >= first) & (qpos < end)
        i = (qpos[rows] - first)[:, None]
        j = torch.arange(n)[None, :]
        if swap.mode == "alibi":
            bias = -swap.slopes.double()[:, None, None] * (i - j).abs()
        else:  # the row alone: the call's partitions restricted to its run
            mbar = swap.partitions(call["layer"], lk).with_seq_len(n).mean_mask()
            bias = mbar[:, i.flatten()].log()
        logits = s[r][:, rows][:, :, first:end] + bias
        logits = logits.masked_fill(j > i, float("-inf"))
        out[r, :, rows, first:end] = torch.softmax(logits, dim=-1)
    return out


def _check_weights(attentions: tuple[torch.Tensor, ...], calls: list[dict[str, Any]], swap: Any) -> None:
    assert len(attentions) == len(calls) == swap.model.config.num_hidden_layers
    for w, call in zip(attentions, calls, strict=True):
        q, v = call["q"], call["v"]
        b, hq, lq, _ = q.shape
        assert w.shape == (b, hq, lq, call["k"].shape[-2]) and w.dtype == q.dtype
        want = _oracle(swap, call)
        torch.testing.assert_close(w.double(), want, atol=2e-6, rtol=1e-5)
        live = want.sum(-1) > 0  # valid query rows
        torch.testing.assert_close(w.double().sum(-1)[live], torch.ones(int(live.sum()), dtype=torch.float64))
        # the weights are the call's: weights @ v is its output, which is the op's output for the call
        vv = v.double().repeat_interleave(hq // v.shape[1], dim=1)
        torch.testing.assert_close((w.double() @ vv).float(), call["out"], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(call["out"], call["op"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["plsh", "alibi"])
def test_output_attentions_are_the_call_weights(family: str, mode: str) -> None:
    model = tiny_model(family)
    x = token_ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: its keys weigh 0, its query rows are 0
    swap = hf.use_positional_lsh(model, num_samples=4) if mode == "plsh" else hf.use_alibi(model)
    with torch.no_grad():
        plain = model(x, attention_mask=mask)
        calls = _record(swap)
        out = model(x, attention_mask=mask, output_attentions=True)
    assert plain.attentions is None
    # asking for the weights changes nothing else (the output from them: float32 rounding)
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=1e-5)
    _check_weights(out.attentions, calls, swap)
    assert bool((out.attentions[0][1, :, :, :4] == 0).all()) and bool((out.attentions[0][1, :, :4] == 0).all())
    with torch.no_grad():
        assert model(x, attention_mask=mask, output_attentions=False).attentions is None  # asked per call


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_exact_alibi_weights_equal_transformers_eager(family: str) -> None:
    """The stock BLOOM and MPT eager attention computes the same ALiBi: their weights are ours."""
    model = tiny_model(family)
    x = token_ids(2, 10)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        stock = model(x, output_attentions=True).attentions
        with hf.use_alibi(model):
            ours = model(x, output_attentions=True).attentions
    for a, b in zip(stock, ours, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_windowed_alibi_weights() -> None:
    model = tiny_model("bloom")
    x = token_ids(1, 12)
    swap = hf.use_alibi(model, window=3.0)
    calls = _record(swap)
    with torch.no_grad():
        w = model(x, output_attentions=True).attentions[0]
    call = calls[0]
    s = call["q"].double() @ call["k"].double().transpose(-1, -2) * call["scale"]
    dist = torch.arange(12)[:, None] - torch.arange(12)[None, :]
    s = (s - swap.slopes.double()[:, None, None] * dist.abs()).masked_fill((dist < 0) | (dist > 3), float("-inf"))
    torch.testing.assert_close(w.double(), torch.softmax(s, dim=-1), atol=2e-6, rtol=1e-5)
    assert bool((w[..., dist > 3] == 0).all())


@pytest.mark.parametrize("family", ["llama", "falcon"])
@pytest.mark.parametrize("mode", ["plsh", "alibi"])
def test_kv_cache_weights(family: str, mode: str) -> None:
    """Continuing a cache: ``(B, Hq, Lq, Lk)`` with the queries aligned to the last keys (GQA: per query head); the
    weights are the decoding call's (weights @ v is its output); exact ALiBi's equal the full call's last rows."""
    model = tiny_model(family)
    x = token_ids(2, 12)
    swap = hf.use_positional_lsh(model, num_samples=4) if mode == "plsh" else hf.use_alibi(model)
    with torch.no_grad():
        full = model(x, output_attentions=True).attentions
        cache = transformers.DynamicCache(config=model.config)
        model(x[:, :9], past_key_values=cache, use_cache=True)
        calls = _record(swap)
        step = model(x[:, 9:], past_key_values=cache, use_cache=True, output_attentions=True).attentions
    heads = model.config.num_attention_heads
    for w, call, f in zip(step, calls, full, strict=True):
        assert w.shape == (2, heads, 3, 12)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, heads, 3))
        assert bool((w[:, :, 0, 10:] == 0).all()) and bool((w[:, :, 1, 11:] == 0).all())  # causal
        vv = call["v"].double().repeat_interleave(heads // call["v"].shape[1], dim=1)
        torch.testing.assert_close((w.double() @ vv).float(), call["out"], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(call["out"], call["op"], atol=2e-5, rtol=1e-4)
        if mode == "alibi":
            torch.testing.assert_close(w, f[:, :, 9:], atol=1e-5, rtol=1e-4)


def test_decoding_weights_span_the_sequence_after_the_cache_dropped_keys() -> None:
    """Found by transformers' greedy and beam-search dict-output tests: with windowed ALiBi (window 3) the default
    ``LiveKeyCache`` drops the keys no later query sees; each decoding step's weights still span every position so
    far (the dropped keys weigh 0), and equal the last row of the weights of a call on the whole sequence so far."""
    model = tiny_model("bloom")
    hf.use_alibi(model, window=3.0)
    x = token_ids(1, 8)
    kw: dict[str, Any] = dict(max_new_tokens=4, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(x, **kw)
        assert [tuple(step[0].shape) for step in out.attentions] == [(1, 4, 8, 8), (1, 4, 1, 9), (1, 4, 1, 10),
                                                                     (1, 4, 1, 11)]  # fmt: skip
        for n, step in enumerate(out.attentions[1:], start=9):
            full = model(out.sequences[:, :n], output_attentions=True).attentions
            for w, f in zip(step, full, strict=True):
                assert bool((w[..., : n - 4] == 0).all())  # beyond the window: dropped, weight 0
                torch.testing.assert_close(w, f[:, :, -1:], atol=1e-6, rtol=1e-5)


def test_too_large_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    x = token_ids(1, 12)
    monkeypatch.setattr(weights_module, "MAX_DENSE_ELEMENTS", 100)  # 4 heads x 12 x 12 weights > 100
    with hf.use_positional_lsh(model, num_samples=2), torch.no_grad():
        with pytest.raises(ValueError, match=r"would materialize .* attention weights") as e:
            model(x, output_attentions=True)
        assert "\n" not in str(e.value)
        assert model(x).logits.shape == (1, 12, 97)  # without the weights, the same call runs


def test_generate_returns_each_steps_weights() -> None:
    model = tiny_model("llama")
    x = token_ids(1, 8)
    with hf.use_positional_lsh(model, num_samples=4), torch.no_grad():
        out = model.generate(x, max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True)
        plain = model.generate(x, max_new_tokens=3, do_sample=False)
    assert torch.equal(out.sequences, plain)
    assert [tuple(step[0].shape) for step in out.attentions] == [(1, 4, 8, 8), (1, 4, 1, 9), (1, 4, 1, 10)]
    for step in out.attentions:
        for w in step:
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["plsh", "alibi"])
def test_output_attentions_set_on_the_config(family: str, mode: str) -> None:
    """``model.config.output_attentions = True`` (transformers' own ``test_attention_outputs`` does it) is accepted
    on a swapped model and returns the same weights as asking per call; a config built with the registered name
    and ``output_attentions=True`` is accepted too."""
    model = tiny_model(family)
    x = token_ids(2, 10)
    swap = hf.use_positional_lsh(model, num_samples=4) if mode == "plsh" else hf.use_alibi(model)
    with torch.no_grad():
        asked = model(x, output_attentions=True).attentions
        model.config.output_attentions = True
        calls = _record(swap)
        out = model(x)
    assert out.attentions is not None
    _check_weights(out.attentions, calls, swap)
    for a, b in zip(asked, out.attentions, strict=True):
        assert torch.equal(a, b)
    model.config.output_attentions = False
    with torch.no_grad():
        assert model(x).attentions is None
    config = type(model.config)(output_attentions=True, attn_implementation=hf.ATTN_IMPLEMENTATION)
    assert config.output_attentions


def test_other_implementations_still_refuse_config_output_attentions() -> None:
    """Only the registered name is accepted: transformers' refusal for sdpa stays."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="output_attentions"):
        model.config.output_attentions = True


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["plsh", "alibi"])
def test_returned_weights_are_on_the_outputs_path(family: str, mode: str) -> None:
    """transformers' ``test_retain_grad_hidden_states_attentions``: ``retain_grad()`` on the returned weights gets a
    gradient after the loss's backward, in every layer; the logits and every parameter's gradient equal those of the
    call without the weights (which runs the op: an independent computation), float64 within 1e-10."""
    model = tiny_model(family, dtype=torch.float64)
    x = token_ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    if family in ("bloom", "falcon", "mpt"):
        mask[0, 6] = 0  # a hole (the Llama family's mask function takes it too; kept to the native ones here)
    _ = hf.use_positional_lsh(model, num_samples=4) if mode == "plsh" else hf.use_alibi(model)
    g = torch.randn(2, 12, 97, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def run(asked: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, ...] | None]:
        model.zero_grad(set_to_none=True)
        out = model(x, attention_mask=mask, output_attentions=asked)
        if asked:
            for w in out.attentions:
                w.retain_grad()
        (out.logits * g).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), grads, out.attentions

    plain_logits, plain_grads, _ = run(False)
    logits, grads, attentions = run(True)
    assert attentions is not None and len(attentions) == model.config.num_hidden_layers
    torch.testing.assert_close(logits, plain_logits, atol=1e-10, rtol=1e-10)
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-10, rtol=1e-10, msg=name)
    for w in attentions:
        assert w.grad is not None and w.grad.shape == w.shape
        assert bool(w.grad.abs().sum() > 0)


@pytest.mark.parametrize("family", ["llama", "bloom"])
@pytest.mark.parametrize("mode", ["plsh", "window"])
@pytest.mark.parametrize("cache", ["static", None])
def test_generate_with_weights_equals_generate_without(family: str, mode: str, cache: str | None) -> None:
    """Decoding with the weights asked for (the output computed from them) gives the tokens and scores of decoding
    without, with the swap's static cache and with its default ``LiveKeyCache`` (windowed ALiBi drops keys), on a
    left-padded batch."""
    model = tiny_model(family)
    _ = hf.use_positional_lsh(model, num_samples=4) if mode == "plsh" else hf.use_alibi(model, window=3.0)
    x = token_ids(2, 10)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    kw: dict[str, Any] = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    if cache is not None:
        kw["cache_implementation"] = cache
    with torch.no_grad():
        plain = model.generate(x, attention_mask=mask, **kw)
        asked = model.generate(x, attention_mask=mask, output_attentions=True, **kw)
    assert torch.equal(asked.sequences, plain.sequences)
    for a, b in zip(asked.scores, plain.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    step = asked.attentions[-1][0]  # the last token's weights: (B, H, 1, keys held)
    assert step.shape[:3] == (2, 4, 1)
    torch.testing.assert_close(step.sum(-1), torch.ones(step.shape[:-1]))


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("family", ["bloom", "llama"])
def test_output_attentions_under_torch_compile_with_dynamic_shapes(family, mode):
    """Found by transformers' ``test_generate_compilation_all_outputs``: under ``torch.compile`` with dynamic shapes,
    dynamo traced the dense weights and failed inside their size check (``InternalTorchDynamoError: Cannot specify
    ',' with 's'``). The weights are an eager computation at a graph break: the compiled call returns the eager
    call's weights and logits (which the tests above check against float64); ``fullgraph=True`` refuses the break."""
    model = tiny_model(family, dtype=torch.float64)
    if mode == "plsh":
        hf.use_positional_lsh(model, num_samples=3, seed=2, slopes=0.5)
    else:
        hf.use_alibi(model)
    ids = token_ids(batch=2, length=9)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, output_attentions=True)
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, backend="eager", dynamic=True)(
            ids, attention_mask=mask, output_attentions=True
        )
        torch.testing.assert_close(compiled.logits, eager.logits, rtol=0, atol=1e-12)
        for a, b in zip(compiled.attentions, eager.attentions, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
            torch.compile(model.forward, backend="eager", dynamic=True, fullgraph=True)(
                ids, attention_mask=mask, output_attentions=True
            )
    torch._dynamo.reset()
