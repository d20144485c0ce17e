"""Decode speed and KV-cache memory of swapped transformers models against the prompt length, and of the stock model.

    nice python benchmarks/hf_decode.py --prompts 2048,32768 --tokens 32 --models qwen3,bloom

For each tiny random model (no download) and prompt length, one prefill, then ``--tokens`` greedy decoding steps
(``model(token, cache=..., use_cache=True)``) for: the stock model as transformers builds it (no swap: BLOOM's own ALiBi
attention, Qwen3's RoPE with sdpa; what a user would otherwise run), positional LSH with the default ``DynamicCache``
and with ``swap.new_cache()`` (``LiveKeyCache``, dead keys dropped), exact ``use_alibi`` with both caches, and windowed
``use_alibi`` with both caches. The stock model runs at prompts up to ``--stock-max`` (``--bloom-stock-max`` for BLOOM)
and takes its prompt in chunks of ``--stock-prefill-chunk`` tokens (its own cache continued chunk by chunk: stock BLOOM
materializes a ``(B H, chunk, n)`` score tensor, 17 GB for the whole 32k prompt at once); how the prompt went in does
not change a decoded token's work. Every (length, run) has its own model copy
and they decode in turns, token by token, in a shuffled order, so that the machine's load hits them alike. Prints, per
run, the median time of a decoded token (tokens/s = 1 / median; also 1 / the 25th percentile, "fastest quarter", which a
busy machine's preemptions disturb less), the KV-cache bytes after decoding, and a markdown table with the ratios: each
run against the stock model and against exact ``use_alibi`` at the same length, and against its own speed at the
shortest length. One process, CPU, torch on one thread; compare ratios within one run. Results: docs/hf.md ("Decoding
speed").
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
import warnings

import torch


def _config(name: str, hidden: int, heads: int, layers: int):
    import transformers as tf

    if name == "bloom":
        return tf.BloomConfig(vocab_size=1000, hidden_size=hidden, n_layer=layers, n_head=heads)
    if name == "qwen3":
        return tf.Qwen3Config(
            vocab_size=1000,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=hidden // heads,
            max_position_embeddings=1 << 17,
        )
    raise SystemExit(f"--models: unknown model {name!r} (qwen3, bloom)")


def _model(name: str, args: argparse.Namespace):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(copy.deepcopy(_config(name, args.hidden, args.heads, args.layers)))
    return model.eval()


def _kv_bytes(cache) -> int:
    """Bytes held for the cached keys and values (a LiveKeyCache's buffers, with their room to grow)."""
    if callable(getattr(cache, "memory_bytes", None)):
        return int(cache.memory_bytes())
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _prefill(model, swap, prompt: torch.Tensor, live: bool, chunk: int | None = None):
    """The cache after the prompt (fed ``chunk`` tokens at a time, or at once), the first decoded token and the
    prefill time."""
    import transformers as tf

    cache = swap.new_cache() if live else tf.DynamicCache(config=model.config)  # swap is None for the stock model
    width = prompt.shape[1] if chunk is None else chunk
    with torch.no_grad():
        t0 = time.perf_counter()
        for a in range(0, prompt.shape[1], width):
            out = model(prompt[:, a : a + width], cache=cache, use_cache=True)
        prefill = time.perf_counter() - t0
    return cache, out.logits[:, -1:].argmax(-1), prefill


def _step(model, cache, token: torch.Tensor) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        return token, time.perf_counter() - t0


def main() -> None:
    from positional_lsh.integrations import hf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="2048,8192,32768", help="prompt lengths")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per run (the median is reported)")
    ap.add_argument("--models", default="qwen3,bloom")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8, help="T of positional LSH")
    ap.add_argument("--sigma", type=float, default=256.0, help="one slope 1/sigma for every head (the paper's 256)")
    ap.add_argument("--window", type=float, default=1024.0, help="largest kept distance of windowed ALiBi")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stock-max", type=int, default=32768, help="longest prompt the stock Qwen3 runs")
    ap.add_argument("--bloom-stock-max", type=int, default=32768, help="longest prompt stock BLOOM runs")
    ap.add_argument(
        "--stock-prefill-chunk",
        type=int,
        default=2048,
        help="the stock model takes its prompt this many tokens at a time",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [int(p) for p in args.prompts.split(",")]
    slopes = 1.0 / args.sigma
    runs = [
        ("stock (no swap)", "stock", False),
        ("plsh, LiveKeyCache", "plsh", True),
        ("plsh, DynamicCache", "plsh", False),
        ("exact use_alibi, LiveKeyCache", "alibi", True),
        ("exact use_alibi", "alibi", False),
        ("windowed, LiveKeyCache", "window", True),
        ("windowed, DynamicCache", "window", False),
    ]
    rows = []
    for name in args.models.split(","):
        base = _model(name, args)
        states = []
        for n in prompts:
            prompt = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
            for label, mode, live in runs:  # one model copy per (length, run): they decode in turns (below)
                cap = args.bloom_stock_max if name == "bloom" else args.stock_max
                if mode == "stock" and n > cap:
                    print(f"{name} n={n:6d} {label}: not run (longer than {cap}; see --stock-max)", flush=True)
                    continue
                model = copy.deepcopy(base)
                swap = None
                if mode == "stock":
                    pass
                elif mode == "plsh":
                    swap = hf.use_positional_lsh(model, num_samples=args.samples, seed=0, slopes=slopes)
                else:
                    swap = hf.use_alibi(model, slopes=slopes, window=args.window if mode == "window" else None)
                chunk = args.stock_prefill_chunk if mode == "stock" else None
                cache, token, prefill = _prefill(model, swap, prompt, live, chunk)
                states.append([n, label, model, swap, cache, token, prefill, []])
        # Round robin over every (length, run): token i of each, then token i + 1, ...: the machine's load hits them
        # alike. The first token of each (which drops the prompt's dead keys) is not timed.
        order = list(range(len(states)))
        shuffle = random.Random(0)
        for i in range(args.tokens + 1):
            shuffle.shuffle(order)  # (a fixed order would give some runs the preemptions that follow a turn)
            for state in (states[j] for j in order):
                state[5], seconds = _step(state[2], state[4], state[5])
                if i:
                    state[7].append(seconds)
        for n, label, _, swap, cache, _, prefill, times in states:
            per_token = statistics.median(times)
            p25 = statistics.quantiles(times, n=4)[0]
            kv = _kv_bytes(cache)
            rows.append((name, n, label, 1 / per_token, 1 / p25, kv))
            print(
                f"{name} n={n:6d} {label:24s} decode {1 / per_token:8.1f} tok/s (median; fastest quarter "
                f"{1 / p25:7.1f})  KV {kv / 2**20:8.2f} MiB  prefill {prefill:7.2f} s  "
                f"reach(layer 0) {None if swap is None else swap.key_reach(0)}",
                flush=True,
            )
            if swap is not None:
                swap.restore()
        del states
    print()
    print(
        "| model | prompt | run | decode tokens/s: median (fastest quarter) | KV cache MiB | vs stock | "
        f"vs exact use_alibi | vs its own speed at {prompts[0]} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    speed = {(m, n, label): (med, fast) for m, n, label, med, fast, _ in rows}

    def ratio(med: float, fast: float, ref: tuple[float, float] | None, unit: str = "x") -> str:
        return "not run" if ref is None else f"{med / ref[0]:.2f}{unit} ({fast / ref[1]:.2f}{unit})"

    for m, n, label, med, fast, kv in rows:
        stock, exact = speed.get((m, n, "stock (no swap)")), speed.get((m, n, "exact use_alibi"))
        first = speed.get((m, prompts[0], label))
        print(
            f"| {m} | {n} | {label} | {med:.0f} ({fast:.0f}) | {kv / 2**20:.2f} | {ratio(med, fast, stock)} | "
            f"{ratio(med, fast, exact)} | {ratio(med, fast, first, '')} |"
        )


if __name__ == "__main__":
    main()
