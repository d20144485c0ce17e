"""Mixed precision (issue 18, failure A): under ``torch.autocast`` a swapped model of every supported type runs, its
attention receives q, k and v in the autocast dtype (as the stock attention computes them), and forward and a
training step agree with the float32 result at bfloat16's usual tolerance."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MODEL_TYPES, tiny_model, token_ids  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.integrations.hf import attention_swap  # noqa: E402

# bfloat16 keeps 8 significant bits (eps = 2^-8 = 3.9e-3); torch.testing's tolerance for it is rtol = 1.6e-2 (about
# 4 eps). Measured on these models: relative errors 2.7e-3 .. 5.5e-3 (logits, loss and gradients), about one eps.
BF16_RTOL = 1.6e-2


def _swap(model, mode: str):
    if mode == "plsh":
        return hf.use_positional_lsh(model, num_samples=4, seed=3)
    return hf.use_alibi(model)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def op_dtypes(monkeypatch):
    """The dtypes of (q, k, v) at every call of the ops the swap runs."""
    seen: list[tuple[torch.dtype, ...]] = []
    for name in ("plsh_attention", "alibi_attention", "plsh_attention_with_kvcache"):
        original = getattr(attention_swap, name, None)
        if original is None:  # (an older swap without the decoding path)
            continue

        def spy(q, k, v, *args, _original=original, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
            return _original(q, k, v, *args, **kwargs)

        monkeypatch.setattr(attention_swap, name, spy)
    return seen


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("name", MODEL_TYPES)
def test_bf16_autocast_forward_and_training_step(name, mode, op_dtypes):
    x = token_ids(length=32)
    results = {}
    for autocast in (False, True):
        model = tiny_model(name)  # float32 weights, the same for both runs
        with _swap(model, mode):
            op_dtypes.clear()
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                logits = model(x).logits
            want = torch.bfloat16 if autocast else torch.float32
            # Every call: q, k and v in one dtype, the autocast dtype, with autocast off inside the op.
            assert op_dtypes and set(op_dtypes) == {(want, want, want, False)}, (name, mode, set(op_dtypes))
            model.train()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = model(x, labels=x, use_cache=False).loss
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            assert all(torch.isfinite(p).all() for p in model.parameters())
        results[autocast] = (logits, loss.detach(), grads)
    (ref, ref_loss, ref_grads), (low, low_loss, low_grads) = results[False], results[True]
    assert low.dtype == torch.bfloat16
    assert _rel(low, ref) < BF16_RTOL
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=BF16_RTOL * ref.abs().max().item())
    assert abs(low_loss.item() - ref_loss.item()) < BF16_RTOL * ref_loss.item()
    assert set(low_grads) == set(ref_grads)
    everything = torch.cat([g.flatten() for g in ref_grads.values()])
    assert _rel(torch.cat([g.flatten() for g in low_grads.values()]), everything) < BF16_RTOL
    assert everything.abs().sum() > 0 and torch.isfinite(everything).all()


@pytest.mark.parametrize("name", ["qwen3", "bloom"])
def test_bf16_autocast_generate_and_float64_untouched(name):
    # Decoding under autocast takes the same route (the decode path included); float64 models are not cast.
    model = tiny_model(name)
    x = token_ids(length=20)
    with hf.use_positional_lsh(model, num_samples=4, seed=1):
        ref = model.generate(x, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
        with torch.autocast("cpu", torch.bfloat16):
            low = model.generate(
                x, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
    first_ref, first_low = ref.scores[0], low.scores[0]  # the first step sees the same prefix in both runs
    assert _rel(first_low, first_ref) < BF16_RTOL
    model64 = tiny_model(name, dtype=torch.float64)
    with hf.use_positional_lsh(model64, num_samples=4, seed=1):
        plain = model64(x).logits
        with torch.autocast("cpu", torch.bfloat16):
            under = model64(x).logits
    assert under.dtype == torch.float64
    torch.testing.assert_close(under, plain, rtol=0, atol=1e-12)
