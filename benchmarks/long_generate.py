"""Generation at any prompt length: peak memory, prefill time and time per generated token of a plain
``model.generate(ids, max_new_tokens=32)`` against the prompt length, from 2k to 1,048,576 tokens.

    nice python benchmarks/long_generate.py --prompts 2048,8192,32768,131072,1048576 --out long_generate.json \\
        --plot docs/figures/long_generate.png

Tiny random models built from their configs (no download: BLOOM and Qwen3, hidden 64, 4 heads, 2 layers, vocabulary
1000), one prompt of random token ids per length, greedy decoding of ``--tokens`` tokens by a plain
``model.generate(ids, max_new_tokens=...)``: after ``use_positional_lsh(model, num_samples=8, slopes=1/sigma)`` and
after a windowed ``use_alibi(model, slopes=1/sigma, window=12 sigma)`` that is the bounded generation the swap sets up
(a ``LiveKeyCache`` and a chunked prefill; docs/hf.md, "Bounded generation by default"); the stock model (no swap:
BLOOM's own eager ALiBi attention, Qwen3's RoPE with sdpa) gets transformers' own generation with its chunked prefill
(``prefill_chunk_size=4096``, the most memory-frugal stock setting) and runs where it fits: a point that would need
more memory than ``--stock-memory`` GiB (BLOOM's ``(B H, chunk, n)`` scores, every point's ``(n, .)`` KV cache) or a
prompt longer than ``--stock-max`` (its prefill is quadratic) is recorded as not run, with the reason, and one that
runs past ``--timeout`` seconds as stopped there.

Every point runs in a fresh process (``--point``), so its peak RSS (``ru_maxrss``) is its own; a streamer timestamps the
tokens: the prefill time is up to the first generated token, the time per token the median gap between the later
ones. A point with a prompt longer than 8,192 tokens then generates again from the prompt's first 8,192 tokens, in
the same process (its peak RSS taken before), so that its time per token has a reference measured under the same
load of the machine (``ref_ms_per_token``). The time per token is also taken on the thread's CPU clock
(``cpu_ms_per_token``, ``ref_cpu_ms_per_token``): what a token costs, without the waits for a core. One torch
thread. The largest prompts run last. Prints one JSON line per point and a markdown table; ``--plot`` draws peak RSS
and time per token against the prompt length (log x). ``--report`` and ``--plot`` keep the latest row of a point
measured more than once (an ``--out`` file appended to by several runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

MODES = ("plsh", "window", "stock")
#: A point with a longer prompt also times its tokens after the first REFERENCE prompt tokens, in the same process.
REFERENCE = 8192
VOCAB = 1000


def tiny_config(name: str):
    import transformers as tf

    if name == "bloom":
        return tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    if name == "qwen3":
        return tf.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1 << 21,
        )
    raise SystemExit(f"--models: unknown model {name!r} (bloom, qwen3)")


class Clock:
    """A generate streamer that timestamps each put (the prompt first, then each generated token), on the wall clock
    (``times``) and on this thread's CPU clock (``cpu``: user and system time, page faults included, the waits for a
    core of a loaded machine not)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []

    def put(self, value: object) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.thread_time())

    @staticmethod
    def median_gap_ms(times: list[float]) -> float:
        """The median gap between the generated tokens after the first two (ms)."""
        return round(1e3 * statistics.median(b - a for a, b in itertools.pairwise(times[2:])), 3)

    def end(self) -> None:
        pass


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def stock_refusal(name: str, n: int, limit_gib: float, max_prompt: int) -> str | None:
    """Why the stock model cannot run a prompt of ``n`` tokens within ``limit_gib`` GiB, or in reasonable time (its
    prefill is quadratic: past ``max_prompt`` tokens), or ``None``."""
    if n > max_prompt:
        pairs = n * n / 2
        return (
            f"quadratic prefill: {pairs:.1e} query-key pairs per head and layer, {pairs / (max_prompt**2 / 2):.0f}x "
            f"those at {max_prompt} (--stock-max)"
        )
    kv = 2 * 2 * (4 if name == "bloom" else 2) * 16 * 4 * n  # layers x (k, v) x kv heads x head dim x float32
    need = kv
    if name == "bloom":  # eager attention: (B H, chunk, n) float32 scores, and their softmax
        need += 2 * 4 * min(n, 4096) * n * 4
    if need > limit_gib * 2**30:
        what = "its (B H, chunk, n) attention scores and " if name == "bloom" else "its "
        return f"needs about {need / 2**30:.0f} GiB for {what}full KV cache (over --stock-memory {limit_gib:g} GiB)"
    return None


def run_point(name: str, mode: str, n: int, tokens: int, sigma: float) -> dict[str, object]:
    """One point, in this process: returns its measurements."""
    import torch
    import transformers as tf

    from positional_lsh.integrations import hf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    model.generation_config.pad_token_id = None
    kwargs: dict[str, object] = {}
    if mode == "plsh":
        hf.use_positional_lsh(model, num_samples=8, seed=0, slopes=1.0 / sigma)
    elif mode == "window":
        hf.use_alibi(model, slopes=1.0 / sigma, window=12.0 * sigma)
    else:
        kwargs["prefill_chunk_size"] = 4096
    ids = torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():  # warm-up, untimed: the CPU kernel's load (or build), lazy imports, first-call costs
        model.generate(ids[:, :64], max_new_tokens=2, do_sample=False, **kwargs)
    before = _rss_mib()
    clock = Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, streamer=clock, **kwargs
        )
    peak = _rss_mib()
    ref: dict[str, object] = {}
    if n > REFERENCE:  # the same model on the first REFERENCE tokens, right after: a ratio the machine's load spares
        ref_clock = Clock()
        with torch.no_grad():
            model.generate(ids[:, :REFERENCE], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           streamer=ref_clock, **kwargs)  # fmt: skip
        ref = {
            "ref_prompt": REFERENCE,
            "ref_ms_per_token": Clock.median_gap_ms(ref_clock.times),
            "ref_cpu_ms_per_token": Clock.median_gap_ms(ref_clock.cpu),
        }
    return {
        "model": name,
        "mode": mode,
        "prompt": n,
        "generated": int(out.shape[1] - n),
        "rss_before_mib": round(before, 1),
        "peak_rss_mib": round(peak, 1),
        "prompt_ids_mib": round(ids.numel() * ids.element_size() / 2**20, 2),
        "prefill_s": round(clock.times[1] - t0, 3),
        "ms_per_token": Clock.median_gap_ms(clock.times),
        "cpu_ms_per_token": Clock.median_gap_ms(clock.cpu),
        "ms_per_token_mean": round(1e3 * (clock.times[-1] - clock.times[2]) / max(1, len(clock.times) - 3), 3),
        **ref,
    }


def _latest(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per point (a point measured again: its latest row), by prompt length, then model and run."""
    latest = {(r["model"], r["mode"], r["prompt"]): r for r in rows}
    order = {mode: i for i, mode in enumerate(MODES)}
    return sorted(latest.values(), key=lambda r: (int(str(r["prompt"])), str(r["model"]), order[str(r["mode"])]))


def _plot(rows: list[dict[str, object]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (name, mode), style in (
        (("bloom", "plsh"), "o-"), (("bloom", "window"), "s-"), (("bloom", "stock"), "x--"),
        (("qwen3", "plsh"), "o:"), (("qwen3", "window"), "s:"), (("qwen3", "stock"), "x-."),
    ):  # fmt: skip
        pts = [r for r in rows if r["model"] == name and r["mode"] == mode and "peak_rss_mib" in r]
        if not pts:
            continue
        xs = [r["prompt"] for r in pts]
        label = f"{name} {'plsh T=8' if mode == 'plsh' else 'windowed ALiBi 12σ' if mode == 'window' else 'stock'}"
        axes[0].plot(xs, [r["peak_rss_mib"] for r in pts], style, label=label)
        cpu = all(r.get("cpu_ms_per_token") is not None for r in pts)  # the thread's CPU time: no waits for a core
        per_token = [r["cpu_ms_per_token" if cpu else "ms_per_token"] for r in pts]
        axes[1].plot(xs, per_token, style, label=label + ("" if cpu else " (wall clock)"))
    titles = ("peak RSS (MiB)", "time per generated token (ms, the thread's CPU time)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[1].yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)  # the stock runs' time per token is wall clock (measured before the CPU column)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| model | run | prompt | peak RSS MiB | prefill s | prefill s / 1k tokens | ms / generated token | "
        "vs 8k, same process | CPU ms / generated token (vs 8k) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        label = {"plsh": "plsh T=8", "window": "windowed ALiBi 12σ", "stock": "stock"}[str(r["mode"])]
        if "peak_rss_mib" not in r:
            lines.append(f"| {r['model']} | {label} | {r['prompt']} | not run: {r['reason']} | | | | | |")
            continue
        per_k = float(r["prefill_s"]) / (int(r["prompt"]) / 1000)
        ref = r.get("ref_ms_per_token")
        paired = f"{float(r['ms_per_token']) / float(ref):.2f}x ({ref:.2f} ms)" if ref else ""
        cpu, ref_cpu = r.get("cpu_ms_per_token"), r.get("ref_cpu_ms_per_token")
        cpu_col = f"{cpu:.2f}" if cpu is not None else ""
        if cpu is not None and ref_cpu:
            cpu_col += f" ({float(cpu) / float(ref_cpu):.2f}x)"
        lines.append(
            f"| {r['model']} | {label} | {r['prompt']} | {r['peak_rss_mib']:.0f} | {r['prefill_s']:.2f} | "
            f"{per_k:.3f} | {r['ms_per_token']:.2f} | {paired} | {cpu_col} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="2048,8192,32768,131072,1048576", help="prompt lengths, comma-separated")
    ap.add_argument("--models", default="bloom,qwen3")
    ap.add_argument("--modes", default=",".join(MODES), help="plsh, window (windowed ALiBi 12 sigma), stock")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per point")
    ap.add_argument("--sigma", type=float, default=256.0, help="one slope 1/sigma for every head")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per point before it is stopped")
    ap.add_argument("--stock-memory", type=float, default=12.0, help="GiB the stock model may need")
    ap.add_argument("--stock-max", type=int, default=262144, help="longest prompt the stock model runs")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--plot", default=None, help="draw the figure (from --out's rows when given) to this path")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)  # "model,mode,n": one point in this process
    ap.add_argument("--report", action="store_true", help="only print the table (and --plot) of --out's rows")
    args = ap.parse_args()
    if args.report:
        with open(args.out, encoding="utf-8") as f:
            rows = _latest([json.loads(line) for line in f if line.strip()])
        print(_table(rows))
        if args.plot:
            _plot(rows, args.plot)
        return
    if args.point:
        name, mode, n = args.point.split(",")
        print(json.dumps(run_point(name, mode, int(n), args.tokens, args.sigma)), flush=True)
        return
    prompts = sorted(int(p) for p in args.prompts.split(","))
    rows: list[dict[str, object]] = []
    for n in prompts:  # the largest last
        for name in args.models.split(","):
            for mode in args.modes.split(","):
                base = {"model": name, "mode": mode, "prompt": n}
                reason = stock_refusal(name, n, args.stock_memory, args.stock_max) if mode == "stock" else None
                if reason is None:
                    cmd = [sys.executable, __file__, "--point", f"{name},{mode},{n}", "--tokens", str(args.tokens),
                           "--sigma", str(args.sigma)]  # fmt: skip
                    try:
                        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
                    except subprocess.TimeoutExpired:
                        reason = f"stopped after {args.timeout:.0f} s (--timeout)"
                    else:
                        if done.returncode == 0:
                            row = json.loads(done.stdout.strip().splitlines()[-1])
                        else:
                            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                            reason = f"failed (exit {done.returncode}): {tail[:120]}"
                row = {**base, "reason": reason} if reason is not None else row
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a", encoding="utf-8") as f:
                        f.write(json.dumps(row) + "\n")
    print()
    print(_table(rows))
    if args.plot:
        if args.out and os.path.isfile(args.out):
            with open(args.out, encoding="utf-8") as f:
                rows = _latest([json.loads(line) for line in f if line.strip()])
        _plot(rows, args.plot)


if __name__ == "__main__":
    main()
