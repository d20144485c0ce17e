"""Time per generated token of a plain ``model.generate`` after a bounded swap, with the sequence at a given depth,
without prefilling it: ``LiveKeyCache`` layers prefilled on 4,096 tokens are moved forward to position ``n - 1``
(their keys are those of the 4,096 tokens; the swap's attention reads only positions and live keys), then
``generate`` runs on ``n`` random ids (the cache gives it the prompt but its last token). This isolates the per-token
cost at depth ``n`` from the prefill, which ``benchmarks/long_generate.py`` times.

    nice python benchmarks/decode_depth.py --models bloom,qwen3 --modes plsh,window --depths 8192,1048576 \
        --repeats 3 --loops plain,stock

Tiny models of ``long_generate.py``: positional LSH (T = 8, sigma = 256) and windowed ALiBi (12 sigma), one torch
thread. ``--loops``: ``plain`` is ``model.generate`` (after the swap: its own decoding loop,
``integrations/hf/generation_loop.py``), ``stock`` transformers' ``generate`` and loop on the same model, swap and
cache (``type(model).generate(model, ...)``: the loop that appends each token to the ``(1, n)`` ids). The depths and
loops alternate within each repeat (machine load affects all alike); prints the median gap between generated tokens
(ms) per depth and loop, on the wall clock and on the thread's CPU clock (what a token costs, without the waits for a
core of a loaded machine), and the ratio to the first depth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_generate as lg


def _per_token_ms(model, swap, ids: torch.Tensor, n: int, tokens: int, loop: str) -> tuple[float, float]:
    """The median wall and CPU time (ms) between generated tokens at depth ``n``, with loop ``loop``."""
    cache = swap.new_cache()
    with torch.no_grad():
        model(ids[:, :4096], cache=cache, use_cache=True)
    for layer in cache.layers:  # move the cache to position n - 1 (its 4,096 keys stand for the live ones)
        shift = n - 1 - layer.cumulative_length
        layer.cumulative_length += shift
        layer.offset += shift
        layer.nonfinite_end = 0
    swap.new_cache = lambda: cache  # the plain generate's default cache is this one
    clock = lg.Clock()  # timestamps on the wall clock (times) and this thread's CPU clock (cpu)
    generate = model.generate if loop == "plain" else lambda *a, **k: type(model).generate(model, *a, **k)
    try:
        with torch.no_grad():
            generate(ids[:, :n], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=clock)
    finally:
        del swap.new_cache
    return lg.Clock.median_gap_ms(clock.times), lg.Clock.median_gap_ms(clock.cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bloom,qwen3")
    parser.add_argument("--modes", default="plsh", help="plsh (T = 8), window (windowed ALiBi 12 sigma)")
    parser.add_argument("--loops", default="plain", help="plain (model.generate), stock (transformers' loop)")
    parser.add_argument("--depths", default="8192,1048576")
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import transformers as tf

    from positional_lsh.integrations import hf

    torch.set_num_threads(1)
    depths = [int(d) for d in args.depths.split(",")]
    if min(depths) <= 4096:
        raise SystemExit("--depths: each depth must exceed 4096 (the cache is prefilled on 4,096 tokens)")
    if not set(args.loops.split(",")) <= {"plain", "stock"}:
        raise SystemExit("--loops: plain, stock")
    loops = args.loops.split(",")
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(lg.tiny_config(name)).eval()
            model.generation_config.pad_token_id = None
            if mode == "plsh":
                swap = hf.use_positional_lsh(model, num_samples=8, seed=0, slopes=1 / 256)
            elif mode == "window":
                swap = hf.use_alibi(model, slopes=1 / 256, window=12 * 256)
            else:
                raise SystemExit(f"--modes: unknown mode {mode!r} (plsh, window)")
            ids = torch.randint(1, lg.VOCAB, (1, max(depths)), generator=torch.Generator().manual_seed(0))
            runs: dict[tuple[str, int], list[tuple[float, float]]] = {(lp, d): [] for lp in loops for d in depths}
            for _ in range(args.repeats):
                for d in depths:
                    for lp in loops:
                        runs[lp, d].append(_per_token_ms(model, swap, ids, d, args.tokens, lp))
            for lp in loops:
                for clock, k in (("wall", 0), ("cpu", 1)):
                    ref = statistics.median(r[k] for r in runs[lp, depths[0]])
                    for d in depths:
                        ms = statistics.median(r[k] for r in runs[lp, d])
                        shown = [round(r[k], 3) for r in runs[lp, d]]
                        what = f"{name} {mode} {lp} {clock} depth {d}"
                        print(f"{what}: {ms:.3f} ms/token (runs {shown}), {ms / ref:.2f}x", flush=True)


if __name__ == "__main__":
    main()
