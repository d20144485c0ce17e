"""``torch.compile(fullgraph=True)`` of a swapped model (issue 18, failure E): eval forward and training steps trace
as one graph (no break inside the attention: before, ``key_valid.all()`` and the partition draw broke it), with and
without a padding mask, on the positional-LSH and the ALiBi paths (the public ops, with the padding as their
``key_padding_mask``), and compute what eager mode computes. The ops' ``opcheck`` with a mask:
tests/ops/test_padding.py. Speed: benchmarks/hf_compile.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import tiny_model, token_ids  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402


def _swap(model, mode: str):
    if mode == "plsh":
        return hf.use_positional_lsh(model, num_samples=4, seed=2)
    return hf.use_alibi(model, window=6.0 if mode == "window" else None)


def _run(name: str, mode: str, mask: torch.Tensor | None, compiled: bool):
    """Two training steps, then an eval forward: losses, gradients, logits, the swap's step, compiled frames."""
    torch._dynamo.reset()
    x = token_ids(length=24)
    model = tiny_model(name).train()
    swap = _swap(model, mode)
    counter = CompileCounterWithBackend("aot_eager")  # AOT autograd: the custom ops' backward is traced too
    fn = torch.compile(model, fullgraph=True, backend=counter) if compiled else model
    losses = []
    for _ in range(2):
        loss = fn(x, labels=x, attention_mask=mask, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        logits = fn(x, attention_mask=mask, use_cache=False).logits
    swap.restore()
    return losses, grads, logits, swap.step, counter.frame_count


def _padding(batch: int = 2, length: int = 24) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[0, -3:] = 0  # right padding
    return mask


@pytest.mark.parametrize(
    "name, mode, mask",
    [
        ("qwen3", "plsh", "padded"),
        ("bloom", "plsh", "ones"),  # a mask of ones, as Trainer passes it
        ("falcon", "plsh", None),
        ("llama", "alibi", "padded"),
        ("bloom", "window", None),
        ("bloom", "alibi", "padded"),  # a native ALiBi model: the exact op with the padding as key_padding_mask
    ],
)
def test_fullgraph_compile_equals_eager(name, mode, mask):
    mask = {"padded": _padding(), "ones": torch.ones(2, 24, dtype=torch.long), None: None}[mask]
    e_losses, e_grads, e_logits, e_step, _ = _run(name, mode, mask, compiled=False)
    c_losses, c_grads, c_logits, c_step, frames = _run(name, mode, mask, compiled=True)
    # One graph for the two training steps (the step counter is a tensor, not a constant of the graph), one more for
    # eval mode; fullgraph=True means no graph break anywhere, the attention included.
    assert frames == 2
    assert c_step == e_step == 2
    for a, b in zip(c_losses, e_losses, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(e_losses[0], e_losses[1]) or mode != "plsh"  # fresh partitions at the second step
    assert set(c_grads) == set(e_grads)
    for n in e_grads:
        torch.testing.assert_close(c_grads[n], e_grads[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_logits, e_logits, rtol=1e-5, atol=1e-5)


def test_no_graph_break_and_packed_sequences_refused_when_the_graph_runs():
    torch._dynamo.reset()
    model = tiny_model("llama")
    hf.use_positional_lsh(model, num_samples=4)
    x = token_ids(length=32)
    explained = torch._dynamo.explain(lambda ids: model(ids, attention_mask=torch.ones_like(ids)).logits)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    # Without a mask, transformers cannot tell packed sequences apart under compile (it would read the position
    # ids): the swap checks them when the graph runs. Eager mode takes them (issue 34 item 25): each document its
    # own sequence. With use_cache left on (the default), transformers does not look for the documents at all: the
    # compiled call used to let them attend to each other without a word (logits 0.22 off the documents' own).
    packed = torch.cat([torch.arange(16), torch.arange(16)])[None].expand(2, -1)
    for use_cache in (False, None):
        with pytest.raises(RuntimeError, match=r"position ids restart \(packed sequences\)"):
            compiled(x, position_ids=packed, use_cache=use_cache)
    assert torch.isfinite(compiled(x, position_ids=torch.arange(32)[None] + 3).logits).all()  # no restart: runs
    with torch.no_grad():
        eager = model(x, position_ids=packed, use_cache=False).logits
        alone = torch.cat([model(x[:, :16]).logits, model(x[:, 16:]).logits], dim=1)
    torch.testing.assert_close(eager, alone, rtol=0, atol=1e-5)
    assert torch.isfinite(compiled(x, use_cache=False).logits).all()
