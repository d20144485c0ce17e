"""Issue 18 (E): ``torch.compile(fullgraph=True)`` of a swapped transformers model against eager mode.

    nice python benchmarks/hf_compile.py --length 1024 --batch 2 --repeats 5

A small random Qwen3 (no download), swapped to positional LSH (T = 8, sigma = 256) or exact ALiBi, with a padding
mask of ones as ``Trainer`` passes it. Measures, in one process, the median over ``--repeats`` of a training step
(forward, loss, backward) and of an eval forward, eager and compiled (inductor, ``fullgraph=True``), timed
alternately; the first compiled call, which compiles, is timed apart (inductor's on-disk cache makes it shorter on
a second run). The attention itself is an opaque custom op under compile; what
inductor can fuse is the rest of the model (norms, MLPs, projections). CPU, torch on ``--threads`` threads; compare
ratios within one run. Results: docs/hf.md ("torch.compile").
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def _model(args: argparse.Namespace):
    import transformers as tf

    cfg = tf.Qwen3Config(
        vocab_size=1000,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        head_dim=args.hidden // args.heads,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.AutoModelForCausalLM.from_config(cfg)


def _measure(model, x: torch.Tensor, mask: torch.Tensor, repeats: int) -> dict[str, tuple[float, float, float]]:
    """``{step: (eager s, compiled s, first compiled call s)}`` for a training step and an eval forward."""
    compiled = torch.compile(model, fullgraph=True)

    def train(fn) -> None:
        model.train()
        fn(x, labels=x, attention_mask=mask, use_cache=False).loss.backward()

    def infer(fn) -> None:
        model.eval()
        with torch.no_grad():
            fn(x, attention_mask=mask, use_cache=False)

    result = {}
    for what, step in (("training step", train), ("eval forward", infer)):
        step(model)  # warm-up
        t0 = time.perf_counter()
        step(compiled)  # compiles
        first = time.perf_counter() - t0
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(repeats):  # alternately, so that the machine's load hits both alike
            for name, fn in (("eager", model), ("compiled", compiled)):
                t0 = time.perf_counter()
                step(fn)
                times[name].append(time.perf_counter() - t0)
        result[what] = (statistics.median(times["eager"]), statistics.median(times["compiled"]), first)
    return result


def main() -> None:
    from positional_lsh.integrations import hf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randint(1, 1000, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    rows = []
    for mode in ("plsh", "alibi"):
        model = _model(args)
        if mode == "plsh":
            hf.use_positional_lsh(model, num_samples=8, seed=0, slopes=1 / 256)
        else:
            hf.use_alibi(model, slopes=1 / 256)
        rows.append((mode, _measure(model, x, torch.ones_like(x), args.repeats)))
        for what, (eager, comp, first) in rows[-1][1].items():
            print(
                f"{mode:5s} {what:13s} eager {eager * 1e3:8.1f} ms  compiled {comp * 1e3:8.1f} ms  "
                f"speed-up {eager / comp:5.2f}x  (first compiled call {first:6.1f} s)",
                flush=True,
            )
    print()
    print("| swap | step | eager ms | compiled ms | compiled vs eager | first compiled call s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, result in rows:
        for what, (eager, comp, first) in result.items():
            print(f"| {mode} | {what} | {eager * 1e3:.0f} | {comp * 1e3:.0f} | {eager / comp:.2f}x | {first:.0f} |")


if __name__ == "__main__":
    main()
