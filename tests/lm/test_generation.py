"""The language model's bounded generation (issue 33): plsh and window-alibi keep only the keys a later query can
reach (LiveKV) and prefill in chunks; the tokens equal those of the recomputation without a cache."""

from __future__ import annotations

import pytest
import torch

from positional_lsh.lm.generation import LiveKV, layer_reach

from conftest import lm_ids as ids
from conftest import tiny_lm as tiny


@pytest.mark.parametrize("position", ["plsh", "window-alibi"])
def test_bounded_chunked_generation_equals_recomputation(position: str) -> None:
    # sigma 4: plsh blocks of a few dozen positions; window 6: keys are dropped during the 80-token prompt (chunks of
    # 8 and 24) and while decoding.
    window = 6.0 if position == "window-alibi" else None
    model = tiny(position, num_samples=3, sigma=4.0, window=window).double()
    prompt = ids(batch=2, length=80)
    want = model.generate(prompt, 10, temperature=0.0, use_cache=False)
    reach = [layer_reach(block.attn, 90) for block in model.blocks]
    assert all(r is not None and r < 60 for r in reach), reach
    seen = []
    for chunk in (8, 24, None):
        got = model.generate(prompt, 10, temperature=0.0, prefill_chunk=chunk, on_token=seen.append)
        assert torch.equal(got, want), chunk
    assert torch.equal(torch.cat(seen[:10], dim=1), want[:, 80:])  # streamed as they came


def test_live_kv_drops_dead_keys_and_keeps_positions() -> None:
    cache = LiveKV(reach=5)
    k = torch.arange(400.0).view(1, 1, 400, 1)
    held = []
    for a in range(0, 400, 4):  # chunks of 4 tokens: keys before the chunk's first position - 5 are dead
        keys, values, first = cache.update(k[:, :, a : a + 4], -k[:, :, a : a + 4])
        assert first == max(0, a - 5) and torch.equal(keys[0, 0, :, 0], torch.arange(first, a + 4.0))
        assert torch.equal(values, -keys)
        held.append(cache.cached_length())
    assert cache.seen == 400 and max(held) <= 2 * (5 + 4 + 4) + 64  # the buffer: twice the live keys, and a margin


def test_full_modes_keep_every_key() -> None:
    for position in ("alibi", "rope", "nope"):
        assert layer_reach(tiny(position).blocks[0].attn, 100) is None
    with pytest.raises(ValueError, match="prefill_chunk"):
        tiny("plsh", sigma=4.0).generate(ids(length=5), 2, prefill_chunk=0)
