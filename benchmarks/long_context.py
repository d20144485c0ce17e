"""The long-context, equal-compute experiment of docs/experiments.md ("Long context at equal compute").

    python benchmarks/long_context.py all          # throughput, train, eval, report (about 90 min, 2-core CPU)
    python benchmarks/long_context.py throughput   # tokens/s of every mode, one session (run it on a quiet machine)
    python benchmarks/long_context.py train        # equal tokens, then equal wall-clock (resumes what exists)
    python benchmarks/long_context.py eval         # 1x, 2x, 4x the training length, all metrics
    python benchmarks/long_context.py noise        # alibi and plsh-t16 again with seed 1: the run-to-run yardstick
    python benchmarks/long_context.py report       # tables (stdout) and the Pareto figure

Question: at equal training compute, is a positional-LSH model (unbiased, noisy) better or worse than exact
ALiBi, and than windowed ALiBi whose window is chosen for the same cost (biased, deterministic)?

Design. Eight models, one architecture (4 layers, 8 heads, width 256), one data order, training length
``--seq-len`` (2048): exact ALiBi; windowed ALiBi at 12 sigma; windowed ALiBi at the factor whose score entries
equal positional LSH's at T = 16 (computed from the partitions, see :func:`equal_cost_window_factor`);
positional LSH at T = 1, 4, 16, 64; RoPE. The learning rate is constant after the warm-up (``--min-lr`` =
``--lr``), so a run can be continued without changing its schedule: every model is first trained for the
*equal-tokens* budget of ``N`` steps (copied to ``<name>@tokens``), then resumed up to its *equal-time* budget
``S_m = N * t_alibi / t_m`` steps, where ``t_m`` is model ``m``'s training step time measured on a quiet machine
in one session (``throughput``): every model then gets the wall-clock time exact ALiBi needed for ``N`` steps.
Measuring the step times once and converting them to step counts keeps the equal-time budget reproducible and
immune to noise from whatever else runs while the models train. (A model slower than exact ALiBi would get
``S_m < N``: its equal-time run is then trained first and the equal-tokens run continues it.) Phase 1 takes
every model to its smaller budget, phase 2 to its larger, so the equal-tokens models can be evaluated while
phase 2 trains (``eval --budgets tokens``).

The positional-LSH method (per-sample blocks or the multiplicity form) changes the speed, not the result (same
partitions, same estimator); each model trains with the faster one, measured in ``throughput``.

Threads. Every stage runs torch with ``--threads`` intra-op threads (default 1). With 2 threads on a 2-core
machine, any other process on either core stalls both of torch's threads (measured: 2-thread training fell
from 685 to about 200 tokens/s while one other process ran); with 1 thread the experiment owns one core and
its timings do not depend on what runs on the other.

Outputs under ``--out`` (runs/long): ``throughput.json``, one run directory per model and budget, ``*.log``,
``eval-tokens/`` and ``eval-time/`` (``plsh eval`` outputs), and the figure ``--figures/long_pareto.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from positional_lsh.lm.checkpoint import is_checkpoint, read_checkpoint_config
from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.model import TransformerLM
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.partition import sample_partitions

ROOT = Path(__file__).resolve().parent.parent
ARCH = {"n_layer": 4, "n_head": 8, "d_model": 256, "vocab_size": 8192}
EQUAL_COST_T = 16
NOISE_MODELS = ("alibi", "plsh-t16")


def models(window_eq: float) -> dict[str, dict[str, object]]:
    """Model name -> ModelConfig fields of its position mode (the architecture is :data:`ARCH`)."""
    return {
        "alibi": {"position": "alibi"},
        "window-12": {"position": "window-alibi", "window_factor": 12.0},
        "window-eq": {"position": "window-alibi", "window_factor": round(window_eq, 3)},
        "plsh-t1": {"position": "plsh", "num_samples": 1},
        "plsh-t4": {"position": "plsh", "num_samples": 4},
        "plsh-t16": {"position": "plsh", "num_samples": 16},
        "plsh-t64": {"position": "plsh", "num_samples": 64},
        "rope": {"position": "rope"},
    }


def union_entries(seq_len: int, n_head: int, num_samples: int, draws: int = 4) -> float:
    """Positional LSH's causal score entries per query per head with the multiplicity form: each query scores
    the union of its ``T`` blocks, keys ``[min_t start_t(i), i]`` (model slopes, mean over ``draws`` draws)."""
    slopes = ModelConfig(n_head=n_head, seq_len=seq_len).slopes()
    pos = torch.arange(seq_len)[:, None]
    total = 0.0
    for seed in range(draws):
        parts = sample_partitions(seq_len, slopes, num_samples, generator=torch.Generator().manual_seed(seed))
        for h in range(n_head):
            lo, _ = block_bounds(parts.pitch[:, h], parts.shift[:, h], seq_len, pos)
            total += float((pos[:, 0] - lo.amin(1) + 1).sum())
    return total / (draws * n_head * seq_len)


def window_entries(seq_len: int, n_head: int, factor: float) -> float:
    """Windowed ALiBi's causal score entries per query per head: ``min(i, w_h) + 1`` keys, ``w_h = factor*sigma_h``."""
    slopes = ModelConfig(n_head=n_head, seq_len=seq_len).slopes()
    i = torch.arange(seq_len, dtype=torch.float64)
    w = torch.floor(factor / slopes)
    return float((torch.minimum(i[None, :], w[:, None]) + 1).mean())


def equal_cost_window_factor(seq_len: int, n_head: int, num_samples: int = EQUAL_COST_T) -> float:
    """The window factor ``f`` (window ``f * sigma_h`` per head) whose causal score entries equal positional LSH's
    at ``num_samples`` with the multiplicity form (:func:`union_entries`); found by bisection."""
    target = union_entries(seq_len, n_head, num_samples)
    lo, hi = 0.0, 64.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if window_entries(seq_len, n_head, mid) < target else (lo, mid)
    return (lo + hi) / 2


def entries_per_query(fields: dict[str, object], seq_len: int, n_head: int) -> float:
    """Causal score entries per query per head of a model's attention at its training length."""
    if fields["position"] == "plsh":
        return union_entries(seq_len, n_head, int(fields["num_samples"]))  # type: ignore[call-overload]
    if fields["position"] == "window-alibi":
        return window_entries(seq_len, n_head, float(fields["window_factor"]))  # type: ignore[arg-type]
    return (seq_len + 1) / 2


# ---------------------------------------------------------------------------------------------------- throughput


def step_time(fields: dict[str, object], seq_len: int, batch: int, repeats: int, method: str | None) -> float:
    """Median seconds of one training step (forward, backward, clipping, AdamW) of one mode, after a warm-up."""
    extra = {} if method is None else {"plsh_method": method}
    cfg = ModelConfig(seq_len=seq_len, **ARCH, **fields, **extra)
    torch.manual_seed(0)
    model = TransformerLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def throughput(args: argparse.Namespace) -> dict[str, object]:
    """Step time of every model (and, for positional LSH and exact ALiBi, of each implementation), one session."""
    factor = equal_cost_window_factor(args.seq_len, ARCH["n_head"])
    result: dict[str, object] = {
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "window_eq_factor": factor,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "modes": {},
    }
    for name, fields in models(factor).items():
        variants: dict[str, dict[str, object]] = {"": {}}
        if fields["position"] == "plsh":
            variants = {m: {"method": m} for m in ("samples", "multiplicity")}
        elif fields["position"] in ("alibi", "window-alibi"):
            variants = {impl: {"impl": impl} for impl in ("sdpa", "chunked")}
        times = {}
        for label, v in variants.items():
            f = dict(fields)
            if "impl" in v:
                f["alibi_impl"] = v["impl"]
            t = step_time(f, args.seq_len, args.batch_size, args.repeats, v.get("method"))  # type: ignore[arg-type]
            times[label] = t
            print(
                f"{name:10s} {label:13s} {t:7.3f} s/step  {args.seq_len * args.batch_size / t:8.0f} tokens/s",
                flush=True,
            )
        best = min(times, key=times.__getitem__)
        result["modes"][name] = {
            "fields": fields,
            "step_seconds": times,
            "best": best,  # type: ignore[index]
            "tokens_per_second": args.seq_len * args.batch_size / times[best],
        }
    path = args.out / "throughput.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return result


# -------------------------------------------------------------------------------------------------------- train


def _flags(fields: dict[str, object], best: str) -> list[str]:
    out = []
    for k, v in fields.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    if fields["position"] == "plsh":
        out += ["--plsh-method", best]
    elif best:
        out += ["--alibi-impl", best]
    return out


def _trained_steps(run: Path) -> int:
    """Steps of the run's latest checkpoint (``-1`` when there is none)."""
    if not is_checkpoint(run):
        return -1
    return int(read_checkpoint_config(run).get("metadata", {}).get("step", -1))


def _train_to(args: argparse.Namespace, name: str, run: Path, steps: int, flags: list[str], seed: int = 0) -> None:
    done = _trained_steps(run)
    if done >= steps:
        print(f"== {run.name}: {steps} steps already trained")
        return
    common = [
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--min-lr",
        str(args.lr),
        "--warmup",
        str(args.warmup),
        "--weight-decay",
        "0.1",
        "--grad-clip",
        "1.0",
        "--eval-interval",
        str(args.eval_interval),
        "--eval-batches",
        str(args.eval_batches),
        "--ckpt-interval",
        str(args.eval_interval),
        "--seed",
        str(seed),
        "--save-dtype",
        "float16",
        "--no-progress",
        f"--threads={args.threads}",
        *(f"--{k.replace('_', '-')}={v}" for k, v in ARCH.items()),
    ]
    resume = ["--resume"] if done >= 0 else []
    cmd = [
        sys.executable,
        "-m",
        "positional_lsh.cli",
        "train",
        "--out",
        str(run),
        "--steps",
        str(steps),
        *common,
        *flags,
        *resume,
    ]
    print(f"== {run.name}: training to step {steps} ({time.strftime('%H:%M:%S')})", flush=True)
    with open(args.out / f"{name}.log", "a") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        subprocess.run(_nice(args) + cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _nice(args: argparse.Namespace) -> list[str]:
    return ["nice", "-n", str(args.nice)] if args.nice else []


def budgets(tp: dict[str, object], steps: int) -> dict[str, tuple[int, int]]:
    """Model -> (equal-tokens steps, equal-time steps): every model gets exact ALiBi's time for ``steps``."""
    modes = tp["modes"]  # type: ignore[index]
    t_ref = modes["alibi"]["step_seconds"][modes["alibi"]["best"]]
    return {m: (steps, max(1, round(steps * t_ref / info["step_seconds"][info["best"]]))) for m, info in modes.items()}


def train(args: argparse.Namespace) -> None:
    """Phase 1: every model to its smaller budget (copied to ``<name>@<budget>``); phase 2: to its larger."""
    tp = json.loads((args.out / "throughput.json").read_text())
    plan = budgets(tp, args.steps)
    for phase in (0, 1):
        for name, (n_tok, n_time) in plan.items():
            info = tp["modes"][name]
            steps, label = sorted([(n_tok, "tokens"), (n_time, "time")])[phase]
            run = args.out / name
            _train_to(args, name, run, steps, _flags(info["fields"], info["best"]))
            copy = args.out / f"{name}@{label}"
            if not copy.exists():
                shutil.copytree(run, copy)


def noise(args: argparse.Namespace) -> None:
    """The yardstick: ``NOISE_MODELS`` again with ``--seed 1`` (initialization, data order, partitions) for the
    equal-tokens budget, evaluated at the training length: how far apart two runs of one model land."""
    tp = json.loads((args.out / "throughput.json").read_text())
    for name in NOISE_MODELS:
        info = tp["modes"][name]
        _train_to(
            args, f"{name}-seed1", args.out / f"{name}-seed1", args.steps, _flags(info["fields"], info["best"]), 1
        )
    _eval(args, [args.out / f"{m}-seed1" for m in NOISE_MODELS], "1", "noise")


# --------------------------------------------------------------------------------------------------------- eval


def _eval(args: argparse.Namespace, runs: list[Path], factors: str, label: str) -> None:
    """``plsh eval`` of ``runs`` at ``factors`` into ``eval-<label>/`` (log ``eval-<label>.log``), unless done."""
    out = args.out / f"eval-{label}"
    if (out / "results.csv").is_file():
        print(f"== eval-{label}: done")
        return
    cmd = [sys.executable, "-m", "positional_lsh.cli", "eval", *map(str, runs), "--factors", factors]
    cmd += ["--max-tokens", str(args.eval_tokens), "--samples", "none", "--out", str(out), "--no-progress"]
    cmd += [f"--threads={args.threads}"]
    print(f"== eval-{label} ({time.strftime('%H:%M:%S')})", flush=True)
    with open(args.out / f"eval-{label}.log", "w") as log:
        subprocess.run(_nice(args) + cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def evaluate(args: argparse.Namespace) -> None:
    tp = json.loads((args.out / "throughput.json").read_text())
    for budget in args.budgets.split(","):
        _eval(args, [args.out / f"{m}@{budget}" for m in tp["modes"]], "1,2,4", budget)


# ------------------------------------------------------------------------------------------------------- report


def _read_csv(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


def report(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tp = json.loads((args.out / "throughput.json").read_text())
    plan = budgets(tp, args.steps)
    modes = tp["modes"]
    ref = modes["alibi"]["tokens_per_second"]
    print(
        f"Training length {tp['seq_len']}, batch {tp['batch_size']}, {tp['threads']} threads, torch {tp['torch']}; "
        f"equal-cost window factor {tp['window_eq_factor']:.2f} sigma\n"
    )
    print(
        "| model | implementation | keys / query / head | step time (s) | tokens/s | vs exact ALiBi "
        "| equal-tokens steps | equal-time steps |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for m, info in modes.items():
        t = info["step_seconds"][info["best"]]
        cost = entries_per_query(info["fields"], tp["seq_len"], ARCH["n_head"])
        print(
            f"| {m} | {info['best'] or '-'} | {cost:.0f} | {t:.2f} | {info['tokens_per_second']:.0f} | "
            f"{info['tokens_per_second'] / ref:.2f}x | {plan[m][0]} | {plan[m][1]} |"
        )
    print("\nValidation (4 fixed batches of the validation split, at the end of each budget):\n")
    print("| model | val ppl, equal tokens | val ppl, equal time | steps (time) | training tokens (time) |")
    print("|---|---:|---:|---:|---:|")
    for m in modes:
        cells = []
        for budget in ("tokens", "time"):
            log = args.out / f"{m}@{budget}" / "log.jsonl"
            recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
            val = [r for r in recs if "val_ppl" in r]
            cells.append(f"{val[-1]['val_ppl']:.1f}" if val else "")
        steps = plan[m][1]
        print(f"| {m} | {cells[0]} | {cells[1]} | {steps} | {steps * tp['seq_len'] * tp['batch_size']:,} |")
    points = {}
    for budget in ("tokens", "time"):
        path = args.out / f"eval-{budget}" / "results.csv"
        if not path.is_file():
            continue
        rows = _read_csv(path)
        cols = [c for c in ("ppl", "mrr", "entropy") if rows and c in rows[0]]
        for r in rows:
            r["factor"] = f"{float(r['factor']):g}"
        print(f"\nEqual {budget}: test perplexity (and MRR, entropy) at 1x / 2x / 4x the training length\n")
        print("| model | attention | " + " | ".join(f"{c} @{f}x" for c in cols for f in (1, 2, 4)) + " |")
        print("|---|---|" + "---:|" * (3 * len(cols)))
        by_key: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
        for r in rows:
            by_key.setdefault((Path(r["model"]).name, r["attention"]), {})[r["factor"]] = r
        for (model, mode), per in by_key.items():
            cells = []
            for c in cols:
                for f in ("1", "2", "4"):
                    v = per.get(f, {}).get(c, "")
                    cells.append(f"{float(v):.3f}" if v and c != "ppl" else (f"{float(v):.1f}" if v else ""))
            print(f"| {model} | {mode} | " + " | ".join(cells) + " |")
            if "1" in per and per["1"]["kind"] == "own":
                name = model.split("@")[0]
                secs = plan[name][0 if budget == "tokens" else 1] * modes[name]["step_seconds"][modes[name]["best"]]
                points.setdefault(name, []).append((secs / 60, float(per["1"]["ppl"]), budget))
    noise_band = None
    noise_csv = args.out / "eval-noise" / "results.csv"
    if noise_csv.is_file():  # the seed-1 reruns next to their seed-0 equal-tokens runs
        seed1 = {Path(r["model"]).name.removesuffix("-seed1"): float(r["ppl"]) for r in _read_csv(noise_csv)}
        print("\nRun-to-run yardstick (equal tokens, test perplexity at 1x, own attention):\n")
        print("| model | seed 0 | seed 1 | difference |\n|---|---:|---:|---:|")
        spread = []
        for m, p1 in seed1.items():
            p0 = next((p[1] for p in points.get(m, []) if p[2] == "tokens"), float("nan"))
            spread.append(abs(math.log(p1) - math.log(p0)))
            print(f"| {m} | {p0:.1f} | {p1:.1f} | {100 * (p1 / p0 - 1):+.1f} % |")
        ref_ppl = next((p[1] for p in points.get("alibi", []) if p[2] == "tokens"), None)
        if ref_ppl is not None and spread:
            noise_band = (ref_ppl * math.exp(-max(spread)), ref_ppl * math.exp(max(spread)))
    for budget in ("tokens", "time"):  # plsh eval's own loss-by-position plot, one per budget
        src = args.out / f"eval-{budget}" / "loss_by_position.png"
        if src.is_file():
            args.figures.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, args.figures / f"long_loss_by_position_{budget}.png")
    if not points:
        return
    fig, ax = plt.subplots(figsize=(7.0, 4.6))
    colors = plt.get_cmap("tab10")
    ends = sorted((pts[-1][1], name) for name, pts in ((n, sorted(p)) for n, p in points.items()))
    gap = 0.035 * (
        max(p[1] for pts in points.values() for p in pts) - min(p[1] for pts in points.values() for p in pts)
    )
    label_y: dict[str, float] = {}
    for y, name in ends:  # labels of the last points, spread apart vertically so they do not overlap
        label_y[name] = max(y, max(label_y.values(), default=-math.inf) + gap)
    for k, (name, pts) in enumerate(points.items()):
        pts.sort()
        color = colors(k % 10)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, alpha=0.5, zorder=1)
        for x, y, b in pts:
            ax.scatter(x, y, marker="o" if b == "tokens" else "s", color=color, zorder=2)
        x_end = pts[-1][0]
        ax.annotate(name, (x_end, pts[-1][1]), xytext=(x_end * 1.02, label_y[name]), fontsize=8, color=color,
                    va="center")  # fmt: skip
    if noise_band:
        ax.axhspan(*noise_band, color="0.85", zorder=0, label="two seeds of one model (alibi, plsh-t16)")
        ax.legend(fontsize=8, loc="upper right")
    right = max(p[0] for pts in points.values() for p in pts)
    ax.set_xlim(right=right * 1.15)  # room for the labels
    ax.set_xlabel("training time (min: quiet-machine step time x steps)")
    ax.set_ylabel(f"test perplexity at {tp['seq_len']} tokens (own attention)")
    ax.set_title("Circles: equal tokens; squares: equal wall-clock (exact ALiBi's time). Lower left is better.",
                 fontsize=9)  # fmt: skip
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.figures.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figures / "long_pareto.png", dpi=120)
    print(f"\nwrote {args.figures / 'long_pareto.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=("throughput", "train", "eval", "noise", "report", "all"))
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "long")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=70, help="equal-tokens budget N (optimizer steps)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=8192, help="test tokens scored per evaluation")
    ap.add_argument("--repeats", type=int, default=3, help="timed training steps per mode (throughput)")
    ap.add_argument("--budgets", default="tokens,time", help="eval: which budgets' checkpoints to evaluate")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of every stage (see docstring)")
    ap.add_argument("--nice", type=int, default=int(os.environ.get("NICE", "0")))
    args = ap.parse_args()
    os.environ.setdefault("PLSH_CACHE_DIR", str(ROOT / "runs" / "cache"))
    torch.set_num_threads(args.threads)
    stages = ("throughput", "train", "eval", "noise", "report") if args.stage == "all" else (args.stage,)
    for stage in stages:
        {"throughput": throughput, "train": train, "eval": evaluate, "noise": noise, "report": report}[stage](args)


if __name__ == "__main__":
    main()
