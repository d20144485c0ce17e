"""``torch.compile(..., dynamic=True)`` of a swapped model (issue 34, item 1): compiled ``generate`` recompiles no
more than the stock model under the same settings, with no graph break (before: 24 frames against the stock
model's 2, a graph break in the scale check, then the recompile limit and a silent fall back to eager); a
``fullgraph=True`` forward and variable-length training steps each trace one graph for every length, and every
compiled call computes what the eager swapped model computes. Compile counts come from a counting backend
(``eager``, or ``aot_eager`` where the backward is traced); inductor was checked by hand (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import tiny_model, token_ids  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402


@pytest.fixture(autouse=True)
def _dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(name: str, mode: str):
    model = tiny_model(name)
    if mode == "plsh":
        hf.use_positional_lsh(model, num_samples=4, seed=2)
    elif mode == "alibi":
        hf.use_alibi(model)
    return model


def _padded(x: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding, as generate batches prompts
    return mask


def _generate_frames(name: str, mode: str) -> int:
    """Frames compiled by ``m.forward = torch.compile(m.forward, dynamic=True)`` over two ``generate`` calls with
    prompts of two lengths (the second left-padded); the tokens and scores equal the eager model's."""
    torch._dynamo.reset()
    counters.clear()
    model, eager = _model(name, mode), _model(name, mode)
    counter = CompileCounterWithBackend("eager")
    model.forward = torch.compile(model.forward, dynamic=True, backend=counter)
    for n, padded in ((10, False), (13, True)):
        x = token_ids(length=n)
        kwargs = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
        if padded:
            kwargs["attention_mask"] = _padded(x)
        got, want = model.generate(x, **kwargs), eager.generate(x, **kwargs)
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])
    return counter.frame_count


def test_compiled_generate_recompiles_no_more_than_the_stock_model():
    stock = _generate_frames("qwen3", "stock")
    swapped = _generate_frames("qwen3", "plsh")
    assert swapped <= stock, (swapped, stock)


@pytest.mark.parametrize(("name", "mode"), [("qwen3", "plsh"), ("bloom", "plsh"), ("qwen3", "alibi")])
def test_fullgraph_dynamic_forward_one_graph_for_every_length(name, mode):
    model, eager = _model(name, mode), _model(name, mode)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    with torch.no_grad():
        for n in (12, 20, 33):
            x = token_ids(length=n)
            got = compiled(x, attention_mask=_padded(x), use_cache=False).logits
            torch.testing.assert_close(got, eager(x, attention_mask=_padded(x), use_cache=False).logits)
            frames.append(counter.frame_count)
    assert frames == [1, 1, 1]


def test_variable_length_training_one_graph_for_every_length():
    """Training steps at three lengths with a padding mask: the losses and gradients of the eager swapped model
    (fresh partitions at each step), and nothing compiled after the first step."""

    def run(compiled: bool):
        torch._dynamo.reset()
        model = _model("qwen3", "plsh").train()
        counter = CompileCounterWithBackend("aot_eager")
        fn = torch.compile(model, fullgraph=True, dynamic=True, backend=counter) if compiled else model
        steps, frames = [], []
        for n in (12, 20, 33):
            x = token_ids(length=n)
            loss = fn(x, labels=x, attention_mask=_padded(x), use_cache=False).loss
            loss.backward()
            steps.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
            model.zero_grad()
            frames.append(counter.frame_count)
        return steps, frames

    got, frames = run(True)
    want, _ = run(False)
    for (loss, grads), (loss_e, grads_e) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=1e-6)
        for k in grads_e:
            torch.testing.assert_close(grads[k], grads_e[k], rtol=1e-5, atol=1e-6)
    assert frames[0] >= 1 and frames[-1] == frames[0], frames
