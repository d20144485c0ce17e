"""Issue 34 (item 2): ``plsh train-hf``'s memory estimate against the measured peak memory of the run.

    nice python benchmarks/train_memory.py --seq-len 2048 --threads 2

Each configuration runs ``plsh train-hf`` for ``--steps`` optimizer steps in a fresh process (a 4-layer Qwen3,
width 512, MLP 1536, 8 query / 4 key-value heads of 64, a 1024-token BPE, float32, CPU) and reports the estimate
the run printed (``plsh train-hf: memory estimate ... = about X``) against the process's peak resident memory
(``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at its end: VmHWM). Configurations: native attention, positional LSH
with T = 4, and positional LSH with T = 64 (the three of the issue), and optionally (``--more``) gradient
checkpointing and bf16 autocast. Not run in CI (minutes); the estimate's terms have a fast test in
tests/integrations/hf/test_hf_train_runs.py. Results: docs/hf.md ("How much memory a run needs").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_MODEL = {  # a 4-layer Qwen3, the shape class
    "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 65536,
    "tie_word_embeddings": True, "attention_dropout": 0.0,
}  # fmt: skip

CONFIGS: dict[str, list[str]] = {
    "native": ["--position", "native"],
    "plsh T=4": ["--position", "plsh", "--num-samples", "4", "--sigma", "256"],
    "plsh T=64": ["--position", "plsh", "--num-samples", "64", "--sigma", "256"],
}
_T16 = ["--position", "plsh", "--num-samples", "16", "--sigma", "256"]
MORE: dict[str, list[str]] = {
    "plsh T=16, gradient checkpointing": [*_T16, "--gradient-checkpointing"],
    "plsh T=16, bf16 autocast": [*_T16, "--autocast", "bfloat16"],
}

_CHILD = """
import resource, sys
from positional_lsh.cli import main
code = main(sys.argv[1:])
print("PEAK_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
sys.exit(code)
"""

_UNITS = {"KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}


def estimate_from(stdout: str) -> float:
    """The bytes of the ``= about X UNIT`` of the run's memory estimate line."""
    line = next(x for x in stdout.splitlines() if x.startswith("plsh train-hf: memory estimate"))
    m = re.search(r"= about ([0-9.]+) (KiB|MiB|GiB)", line)
    assert m is not None, line
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_one(flags: list[str], work: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(estimate, measured peak RSS) in bytes of one ``plsh train-hf`` run in a fresh process."""
    out = work / "run"
    cmd = [sys.executable, "-c", _CHILD, "train-hf", "--out", str(out), "--overwrite", "--config",
           str(work / "config.json"), "--data", str(work / "texts"), "--vocab-size", "1024", "--cache-dir", "",
           "--seq-len", str(args.seq_len), "--batch-size", "1", "--steps", str(args.steps), "--eval-interval", "1000",
           "--eval-batches", "1", "--ckpt-interval", "1000", "--no-progress", "--threads", str(args.threads),
           "--device", "cpu", *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    peak = float(proc.stdout.split("PEAK_KIB")[-1].split()[0]) * 1024
    return estimate_from(proc.stdout), peak


def main(argv: list[str] | None = None) -> list[tuple[str, float, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--more", action="store_true", help="also gradient checkpointing and bf16 autocast")
    args = ap.parse_args(argv)
    from positional_lsh.lm import data as D

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(_MODEL), encoding="utf-8")
        (work / "texts").mkdir()
        for i, doc in enumerate(D.load_corpus()[:40]):
            (work / "texts" / f"doc{i:02d}.txt").write_text(doc.text, encoding="utf-8")
        print("| run | estimate | measured peak RSS | estimate / measured |\n| --- | --- | --- | --- |")
        for name, flags in {**CONFIGS, **(MORE if args.more else {})}.items():
            est, peak = run_one(flags, work, args)
            rows.append((name, est, peak))
            print(f"| {name} | {est / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | {est / peak:.2f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
