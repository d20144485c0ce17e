"""4-D attention masks (issue 19, #13): every swapped family refuses them with the same clear message. Before, BLOOM
and Falcon failed inside the stock model code ("too many values to unpack", building their ALiBi tensor from the
mask) while MPT and the Llama family named the problem."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import MODEL_TYPES, tiny_model, token_ids  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402

MESSAGE = r"unsupported attention mask \(2, 1, 10, 10\).*only a 2-D \(batch, seq_len\) padding mask"


@pytest.mark.parametrize("mode", ["plsh", "alibi"])
@pytest.mark.parametrize("name", MODEL_TYPES)
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
