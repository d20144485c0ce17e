"""Nothing silent, nothing lost: refusals, one-line errors, atomic checkpoint sets, signals and kills.

Every case of docs/reliability.md has its test here. Models are tiny and runs a few steps, so the whole file
takes well under two minutes on two cores.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from positional_lsh import cli
from positional_lsh.lm import data as D
from positional_lsh.lm.checkpoint import checkpoint_dir, load_checkpoint
from positional_lsh.ops.errors import UserError


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    docs = D.load_corpus()
    for i, d in enumerate(docs[:4] + docs[20:24]):
        (root / f"doc{i:02d}.txt").write_text(d.text[:4000], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer_file(text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    splits = D.load_splits(str(text_dir))
    return D.train_tokenizer(splits["train"], 300).save(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def tiny(out: Path, text_dir: Path, tok: Path, *extra: str, steps: int = 3) -> list[str]:
    return ["train", "--out", str(out), "--data", str(text_dir), "--tokenizer", str(tok), "--cache-dir", "",
            "--seq-len", "32", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--position", "plsh",
            "--num-samples", "2", "--steps", str(steps), "--warmup", "1", "--lr", "3e-3", "--batch-size", "2",
            "--eval-interval", "100", "--eval-batches", "1", "--ckpt-interval", "1", "--threads", "1",
            "--autocast", "float32", "--no-progress", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def run(text_dir: Path, tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run (read-only for the tests: copy it before changing it)."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert cli.main(tiny(out, text_dir, tokenizer_file)) == 0
    return out


def snapshot(*paths: Path) -> dict[str, str]:
    """SHA-256 of every file under ``paths``: 'nothing on disk changed' is an equal snapshot."""
    out = {}
    for root in paths:
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *watch: Path, match: str = "") -> str:
    """``plsh ARGV`` exits 2 with one line on stderr containing ``match``, and changes nothing under ``watch``."""
    before = snapshot(*watch)
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"plsh {argv[0]}: error: "), err
    assert match in err, err
    assert snapshot(*watch) == before
    return err


def copy_run(run: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(run, dest)
    return dest


# ---- 5: a new run into an existing run directory -------------------------------------------------------------


def test_new_run_refuses_existing_run_dir(run: Path, text_dir: Path, tokenizer_file: Path, tmp_path: Path, capsys):
    out = copy_run(run, tmp_path / "run")
    err = refused(tiny(out, text_dir, tokenizer_file), capsys, out, match=str(out))
    assert "--resume" in err and "--overwrite" in err
    refused(tiny(out, text_dir, tokenizer_file, "--resume", "--overwrite"), capsys, out, match="one of them")
    assert cli.main(tiny(out, text_dir, tokenizer_file, "--overwrite", steps=2)) == 0
    assert load_checkpoint(out).metadata["step"] == 2
    assert [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r] == [1, 2]


# ---- 6: a swapped tokenizer -----------------------------------------------------------------------------------


def test_swapped_tokenizer_is_refused(run: Path, text_dir: Path, tokenizer_file: Path, tmp_path: Path, capsys):
    out = copy_run(run, tmp_path / "run")
    other = D.train_tokenizer([D.load_corpus()[100].text[:20000]], 300)
    assert other.vocab_size == D.BPETokenizer.load(tokenizer_file).vocab_size
    other.save(checkpoint_dir(out) / "tokenizer.json")
    with pytest.raises(UserError, match="fingerprint") as info:
        load_checkpoint(out)
    assert other.fingerprint[:16] in str(info.value)
    refused(["eval", str(out), "--data", str(text_dir), "--factors", "1", "--samples", "none", "--no-progress"],
            capsys, out, match=other.fingerprint[:16])  # fmt: skip
    refused(tiny(out, text_dir, tokenizer_file, "--resume"), capsys, out, match="fingerprint")
    other.save(tmp_path / "other.json")
    good = copy_run(run, tmp_path / "good")
    refused(["eval", str(good), "--data", str(text_dir), "--tokenizer", str(tmp_path / "other.json"), "--factors",
             "1", "--samples", "none", "--no-progress"], capsys, good, match="fingerprint")  # fmt: skip


# ---- 9: flags given with --resume -----------------------------------------------------------------------------


def test_resume_restores_threads_and_refuses_conflicts(text_dir: Path, tokenizer_file: Path, tmp_path: Path, capsys):
    out = tmp_path / "run"
    assert cli.main(tiny(out, text_dir, tokenizer_file, "--stop-after", "2", steps=4)) == 0
    base = [a for a in tiny(out, text_dir, tokenizer_file, "--resume", steps=4) if a != "--threads"]
    refused([*base[:3], "--resume", "--lr", "0.5"], capsys, out, match="--lr 0.5 conflicts with the run's 0.003")
    refused([*base[:3], "--resume", "--position", "alibi"], capsys, out, match="--position alibi")
    refused([*base[:3], "--resume", "--threads", "2"], capsys, out, match="--threads 2 conflicts with the run's 1")
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cli.main([*base[:3], "--resume", "--steps", "5", "--no-progress"]) == 0
        assert torch.get_num_threads() == 1  # the run's thread count, restored
    finally:
        torch.set_num_threads(prev)  # this process's count for the tests after this one (tests/conftest.py: 1)
    assert "--steps changes from 4 to 5" in capsys.readouterr().err
    assert load_checkpoint(out).metadata["step"] == 5


# ---- 10: plsh eval scoring nothing, bad values, unwritable --out ----------------------------------------------


def test_eval_refuses_before_the_work(run: Path, text_dir: Path, tmp_path: Path, capsys):
    ev = ["eval", str(run), "--data", str(text_dir), "--samples", "none", "--no-progress"]
    refused([*ev, "--max-tokens", "20", "--factors", "1"], capsys, run, match="nothing to score")
    refused([*ev, "--factors", "100000"], capsys, run, match="nothing to score")
    refused([*ev, "--max-tokens", "0"], capsys, run, match="max_tokens")
    refused([*ev, "--max-tokens", "-5"], capsys, run, match="max_tokens")
    (tmp_path / "file").write_text("x")
    t0 = time.perf_counter()
    refused([*ev, "--factors", "1", "--out", str(tmp_path / "file" / "res")], capsys, run, tmp_path, match="--out")
    assert time.perf_counter() - t0 < 5


# ---- 11: one text file --------------------------------------------------------------------------------------


def test_one_text_file_is_split_by_position(text_dir: Path, tmp_path: Path):
    one = tmp_path / "book.txt"
    one.write_text("\n".join(p.read_text() for p in sorted(text_dir.glob("*.txt"))), encoding="utf-8")
    splits = D.load_splits(str(one))
    assert all(splits[s] and splits[s][0].text.strip() for s in D.SPLITS)
    assert sum(len(splits[s][0].text) for s in D.SPLITS) == len(one.read_text())
    assert len(splits["validation"][0].text) < len(splits["train"][0].text)


# ---- 12: absurd sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--num-samples", "1000000", "--position", "plsh"],
        ["demo", "--lengths", "1000000000"],
        ["bench", "--lengths", "1000000000"],
    ],
)
def test_absurd_sizes_are_refused_with_the_estimate(argv: list[str], tmp_path: Path, capsys):
    if argv[0] == "train":
        argv = [*argv, "--out", str(tmp_path / "run")]
    else:
        argv = [*argv, "--out", str(tmp_path / "bench")] if argv[0] == "bench" else argv
    refused(argv, capsys, tmp_path, match="of memory")
    assert not any(tmp_path.iterdir())


# ---- every user-caused error: one line, exit 2, nothing changed -----------------------------------------------


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


CORRUPTIONS = {
    "truncated weights": lambda d: _truncate(d / "model.safetensors"),
    "config not JSON": lambda d: (d / "config.json").write_text("{not json"),
    "config wrong fields": lambda d: (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "model": {"n_layer": 1, "colour": 3}})
    ),
    "shape-mismatched weights": lambda d: (d / "config.json").write_text(
        json.dumps(
            {
                **json.loads((d / "config.json").read_text()),
                "model": {**json.loads((d / "config.json").read_text())["model"], "d_model": 64},
            }
        )
    ),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_damaged_checkpoint_is_one_line(name: str, run: Path, text_dir: Path, tmp_path: Path, capsys):
    out = copy_run(run, tmp_path / "run")
    CORRUPTIONS[name](checkpoint_dir(out))
    ev = ["eval", str(out), "--data", str(text_dir), "--factors", "1", "--samples", "none", "--no-progress"]
    err = refused(ev, capsys, out)
    assert str(checkpoint_dir(out)) in err
    with pytest.raises(UserError):  # --debug: the traceback instead of the line
        cli.main(["--debug", *ev])


@pytest.mark.parametrize("name", ["trainer_state.pt", "train_config.json"])
def test_damaged_run_files_refuse_resume(name: str, run: Path, text_dir: Path, tokenizer_file, tmp_path, capsys):
    out = copy_run(run, tmp_path / "run")
    target = checkpoint_dir(out) / name if name.endswith(".pt") else out / name
    target.write_bytes(b"garbage\x00\x01")
    refused(tiny(out, text_dir, tokenizer_file, "--resume"), capsys, out, match=name)


def test_bad_data_and_flags_are_one_line(run: Path, text_dir: Path, tokenizer_file: Path, tmp_path: Path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty.txt").write_text("")
    (bad / "binary.txt").write_bytes(b"\x00\x01\x02" * 100)
    (bad / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    for f, match in (("empty.txt", "empty"), ("binary.txt", "binary"), ("latin1.txt", "utf-8")):
        refused(tiny(tmp_path / f"out-{f}", bad / f, tokenizer_file), capsys, bad, match=match)
    if not torch.cuda.is_available():
        refused(tiny(tmp_path / "cuda", text_dir, tokenizer_file, "--device", "cuda"), capsys, match="CUDA")
        assert not (tmp_path / "cuda").exists()
    (tmp_path / "afile").write_text("x")
    refused(tiny(tmp_path / "afile" / "run", text_dir, tokenizer_file), capsys, tmp_path, match="is a file")


def test_truncated_token_cache_is_named(text_dir: Path, tokenizer_file: Path, tmp_path: Path, capsys):
    cache = tmp_path / "cache"
    argv = [a if a != "" else str(cache) for a in tiny(tmp_path / "a", text_dir, tokenizer_file, steps=1)]
    assert cli.main(argv) == 0
    (files,) = [list(cache.rglob("*.pt"))]
    _truncate(files[0])
    argv = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in argv]
    err = refused(argv, capsys, cache, match=str(files[0]))
    assert "token cache" in err and "checkpoint" not in err


# ---- 8: SIGINT / SIGTERM ------------------------------------------------------------------------------------


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _start(argv: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "positional_lsh.cli", *argv], env={**ENV, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for_steps(out: Path, n: int, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        log = out / "log.jsonl"
        if log.is_file() and len(log.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)


def _consistent(out: Path) -> int:
    """The step of the run's checkpoint, after checking weights, config.json and trainer state agree."""
    ck = load_checkpoint(out)
    state = torch.load(checkpoint_dir(out) / "trainer_state.pt", weights_only=True)
    assert state["step"] == ck.metadata["step"]
    weights = ck.model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in state["model"].items())
    return int(state["step"])


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_checkpoint_and_exits(sig, code, text_dir: Path, tokenizer_file: Path, tmp_path: Path):
    out = tmp_path / "run"
    proc = _start(tiny(out, text_dir, tokenizer_file, "--ckpt-interval", "100000", steps=100000))
    _wait_for_steps(out, 3, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "checkpoint saved" in err
    step = _consistent(out)
    logged = [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]
    assert step >= 3 and logged[-1] == step


# ---- 7: kills at random points, inside checkpoint writing too -------------------------------------------------


def test_random_kills_leave_one_consistent_checkpoint(text_dir: Path, tokenizer_file: Path, tmp_path: Path):
    steps = 12
    ref = tmp_path / "ref"  # every run in a fresh process: no global torch state left by other tests
    proc = _start(tiny(ref, text_dir, tokenizer_file, steps=steps))
    assert proc.wait(timeout=120) == 0, proc.communicate()[1]
    out, rng, kills = tmp_path / "run", random.Random(11), 0
    for _ in range(6):
        resume = (out / "LATEST").is_file()
        argv = tiny(out, text_dir, tokenizer_file, "--resume" if resume else "--overwrite", steps=steps)
        proc = _start(argv, PLSH_FAULT_PAUSE="0.04")
        _wait_for_steps(out, 1 if not resume else 0, proc)
        time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.communicate(timeout=60)
        if (out / "LATEST").is_file():
            _consistent(out)
        if proc.returncode == 0:
            break
    assert kills >= 3
    if load_checkpoint(out).metadata["step"] < steps:
        proc = _start(tiny(out, text_dir, tokenizer_file, "--resume", steps=steps))
        assert proc.wait(timeout=120) == 0, proc.communicate()[1]
    assert _consistent(out) == steps
    a, b = load_checkpoint(ref).model.state_dict(), load_checkpoint(out).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    logs = [[r for r in map(json.loads, (d / "log.jsonl").read_text().splitlines()) if "loss" in r] for d in (ref, out)]
    assert [r["step"] for r in logs[1]] == list(range(1, steps + 1))  # no step logged twice
    assert [r["loss"] for r in logs[0]] == [r["loss"] for r in logs[1]]


# =============================================================================================================
# One test per problem found by the hostile probes, numbered as in docs/reliability.md ("Hostile probes")
# =============================================================================================================


def parser_refused(argv: list[str], capsys: pytest.CaptureFixture[str], match: str = "") -> str:
    """``plsh ARGV`` refused by the argument parser: exit 2 (argparse's ``SystemExit``), one line naming the flag."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"plsh {argv[0]}: error: "), err
    assert match in err, err
    return err


def _qkv(b: int, h: int, n: int, d: int, seed: int = 0, **kw) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=torch.float64).to(**kw) for _ in range(3))


# ---- R2-1: subnormal (and tiny) slopes in the multiplicity form ----------------------------------------------


@pytest.mark.parametrize("slope", [1e-310, 5e-324, 2e-308, 1e-20])
def test_subnormal_slopes_give_the_oracles_answer(slope: float):
    from positional_lsh import PositionalLSHAttention, dense_plsh_attention, plsh_attention, sample_partitions

    q, k, v = _qkv(1, 2, 64, 8)
    slopes = torch.tensor([slope, 0.5], dtype=torch.float64)
    for scheme in ("discrete", "gamma", "discrete-strat", "gamma-strat", "discrete-antithetic"):
        parts = sample_partitions(64, slopes, 8, scheme=scheme, generator=0)
        # One block (pitch inf) has shift 0; a finite pitch keeps its shift in [0, pitch).
        inf = torch.isinf(parts.pitch)
        assert bool((parts.shift[inf] == 0).all()) and bool((parts.shift[~inf] < parts.pitch[~inf]).all())
        for causal in (True, False):
            want = dense_plsh_attention(q, k, v, parts, causal=causal)
            for method in ("auto", "samples", "multiplicity"):
                got = plsh_attention(q, k, v, partitions=parts, causal=causal, method=method)
                torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # The repro: auto picks the multiplicity form at 16 samples; and the module.
    want = dense_plsh_attention(q, k, v, sample_partitions(64, slopes, 16, generator=3))
    torch.testing.assert_close(plsh_attention(q, k, v, slopes=slopes, num_samples=16, generator=3), want)
    module = PositionalLSHAttention(2, slopes, num_samples=16, eval_seed=3).eval()
    torch.testing.assert_close(module(q, k, v), dense_plsh_attention(q, k, v, module.sample(64)))


# ---- R2-3: Partitions values are checked where they are made ---------------------------------------------------


def test_partition_values_are_checked_where_they_are_made():
    import dataclasses

    from positional_lsh import Partitions, register_scheme, sample_partitions, unregister_scheme

    gamma = sample_partitions(16, [0.5, 0.1], 4, scheme="gamma", generator=0)
    bad = {
        "gamma pitches relabelled discrete": dict(scheme="discrete"),
        "negative pitch": dict(pitch=-gamma.pitch),
        "NaN pitch": dict(pitch=gamma.pitch * math.nan),
        "shift = pitch": dict(shift=gamma.pitch.clone()),
        "negative shift": dict(shift=-gamma.shift - 1),
        "inf shift": dict(shift=gamma.shift + math.inf),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match="Partitions of scheme"):
            dataclasses.replace(gamma, **change)
            pytest.fail(f"accepted: {name}")
        with pytest.raises(ValueError, match="Partitions of scheme"):  # by hand too
            Partitions(16, gamma.slopes, change.get("pitch", gamma.pitch), change.get("shift", gamma.shift),
                       change.get("scheme", "gamma"))  # fmt: skip
    # The documented inf (one block) is fine, and so are integer values under an integer scheme.
    Partitions(16, gamma.slopes, torch.tensor([[math.inf, 3.0]]), torch.tensor([[0.0, 2.0]]), "discrete")
    # A registered sampler's output is checked, naming the scheme.
    register_scheme("half-integer", lambda m, t, g: (torch.full((t, m.numel()), 2.5, dtype=torch.float64),
                                                     torch.zeros(t, m.numel(), dtype=torch.float64)),
                    unbiased=False, integer=True)  # fmt: skip
    register_scheme("nan-shift", lambda m, t, g: (torch.full((t, m.numel()), 3.0, dtype=torch.float64),
                                                  torch.full((t, m.numel()), math.nan, dtype=torch.float64)),
                    unbiased=False, integer=False)  # fmt: skip
    try:
        with pytest.raises(ValueError, match=r"sampler of scheme 'half-integer'.*integer"):
            sample_partitions(16, [0.5], 2, scheme="half-integer")
        with pytest.raises(ValueError, match="sampler of scheme 'nan-shift'"):
            sample_partitions(16, [0.5], 2, scheme="nan-shift")
    finally:
        unregister_scheme("half-integer")
        unregister_scheme("nan-shift")


# ---- R2-4: partitions.select([]) -------------------------------------------------------------------------------


def test_selecting_no_samples_is_refused():
    from positional_lsh import plsh_attention, sample_partitions

    parts = sample_partitions(16, [0.5], 4, generator=0)
    for empty in ([], slice(0, 0), torch.zeros(0, dtype=torch.long)):
        with pytest.raises(ValueError, match="at least one sample"):
            parts.select(empty)
    q, k, v = _qkv(1, 1, 16, 4)
    assert plsh_attention(q, k, v, partitions=parts.select([2])).isfinite().all()


# ---- R2-7: disk full during a checkpoint -----------------------------------------------------------------------


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_previous_set(
    text_dir: Path, tokenizer_file: Path, tmp_path: Path, capsys, monkeypatch
):
    import safetensors.torch
    from safetensors import SafetensorError

    from positional_lsh.lm import run_dir

    # The first checkpoint fails (safetensors' own error for a full disk): one line, exit 2, nothing half-written.
    real_save = safetensors.torch.save_file

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    first = tmp_path / "first"
    capsys.readouterr()
    assert cli.main(tiny(first, text_dir, tokenizer_file, steps=2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on device" in err[0] and str(first / "steps") in err[0], err
    assert not list((first / "steps").glob(".tmp-*")) and not (first / "LATEST").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)

    # A later checkpoint fails in torch.save ("unexpected pos", the disk nearly full): the previous set is kept.
    real_torch_save, calls = torch.save, []

    def full_at_second(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096})())
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real_torch_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(run_dir.torch, "save", full_at_second)
    out = tmp_path / "run"
    assert cli.main(tiny(out, text_dir, tokenizer_file, steps=3)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on device" in err[0] and "previous checkpoint is kept" in err[0], err
    assert not list((out / "steps").glob(".tmp-*"))
    monkeypatch.undo()
    assert _consistent(out) == 1  # the set of step 1, whole
    assert cli.main(tiny(out, text_dir, tokenizer_file, "--resume", steps=3)) == 0
    assert _consistent(out) == 3


def test_half_written_sets_are_removed_without_a_latest_pointer(tmp_path: Path):
    from positional_lsh.lm.run_dir import clean_stale

    stale = tmp_path / "steps" / ".tmp-step-00000001-abcdef01"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 100)
    clean_stale(tmp_path)
    assert not stale.exists()


# ---- R2-8: plsh validate --adversarial bad values --------------------------------------------------------------


ADV = ["validate", "--adversarial", "--adversarial-lengths", "16", "--adversarial-samples", "2", "--no-plots",
       "--quiet"]  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--adversarial-lengths", "1", ">= 2"),
        ("--adversarial-sigma", "inf", "finite"),
        ("--adversarial-head-dim", "0", "adversarial_head_dim"),
        ("--adversarial-score-bound", "1e6", "adversarial_score_bound"),
        ("--adversarial-rows", "0", "adversarial_rows"),
        ("--adversarial-samples", "10000000", "of memory"),  # at the default lengths (256, 1024, 4096)
    ],
    ids=["lengths-1", "sigma-inf", "head-dim-0", "score-bound-1e6", "rows-0", "samples-1e7"],
)
def test_validate_adversarial_bad_values_are_one_line(flag, value, match, tmp_path: Path, capsys):
    out = tmp_path / "val"
    argv = [*ADV, "--out", str(out), flag, value]
    if flag == "--adversarial-samples":
        argv = [a for a in argv if a not in ("--adversarial-lengths", "16")]
    t0 = time.perf_counter()
    refused(argv, capsys, tmp_path, match=match)
    assert time.perf_counter() - t0 < 10 and not out.exists()


def test_validate_adversarial_with_a_huge_sigma_runs(tmp_path: Path, capsys):
    # sigma = 1e300: every mask is exact (error 0, bound 0); the ratios are 0, not a ZeroDivisionError.
    assert cli.main([*ADV, "--out", str(tmp_path / "val"), "--adversarial-sigma", "1e300"]) == 0
    assert "0 input(s) above the uniform bound" in capsys.readouterr().out


# ---- R2-9: huge sizes are refused up front, with the estimate --------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["validate", "--source", "synthetic", "--seq-lens", "1000000000"], "of memory"),
        (["validate", "--source", "synthetic", "--lengths", "1000000000"], "of memory"),
        (["eval", "--samples", "10000000"], "would take about"),
        (["bench", "--samples", "10000000"], "--samples 10000000"),
    ],
    ids=["validate-seq-lens", "validate-lengths", "eval-samples", "bench-samples"],
)
def test_huge_sizes_are_refused_with_the_estimate(argv: list[str], match: str, tmp_path: Path, capsys):
    if argv[0] in ("validate", "bench"):
        argv = [*argv, "--out", str(tmp_path / "out")]
    t0 = time.perf_counter()
    refused(argv, capsys, tmp_path, match=match)
    assert time.perf_counter() - t0 < 10 and not any(tmp_path.iterdir())


@pytest.mark.parametrize("method", ["auto", "samples", "multiplicity"])
def test_plsh_attention_refuses_a_million_samples_up_front(method: str, monkeypatch):
    from positional_lsh import PositionalLSHAttention, plsh_attention
    from positional_lsh.ops import attention
    from positional_lsh.ops.partitions.sampling import PartitionSampler

    def drawn(*args: object, **kwargs: object) -> None:
        pytest.fail("partitions were drawn before the size check")

    module = PositionalLSHAttention(4, num_samples=10**6, method=method)
    monkeypatch.setattr(attention, "sample_partitions", drawn)  # plsh_attention's draw
    monkeypatch.setattr(PartitionSampler, "draw", drawn)  # the module's draw
    q = torch.randn(1, 4, 4096, 16)
    with pytest.raises(UserError, match=r"num_samples=1000000.*(would take about|of memory)"):
        plsh_attention(q, q, q, num_samples=10**6, method=method)
    with pytest.raises(UserError, match=r"would take about|of memory"):
        module(q, q, q)


# ---- R2-10, R2-11: other tracebacks; work done, then lost --------------------------------------------------------


def test_eval_infinite_factor_and_bench_without_methods_are_one_line(tmp_path: Path, capsys):
    parser_refused(["eval", "--factors", "inf"], capsys, match="--factors")
    refused(["bench", "--methods", "", "--out", str(tmp_path / "b")], capsys, tmp_path, match="methods")


def test_out_is_checked_before_any_work(run: Path, text_dir: Path, tmp_path: Path, capsys, monkeypatch):
    from positional_lsh.cli import bench

    monkeypatch.setattr(bench, "run_benchmark", lambda cfg: pytest.fail("the benchmark ran"))
    existing = tmp_path / "results.csv"
    existing.write_text("keep me")
    refused(["bench", "--lengths", "64", "--out", str(existing)], capsys, tmp_path, match="--out")
    t0 = time.perf_counter()
    refused(["eval", str(run), "--data", str(text_dir), "--factors", "1", "--samples", "none", "--no-progress",
             "--out", "/proc/plsh-results"], capsys, run, tmp_path, match="--out /proc/plsh-results")  # fmt: skip
    assert time.perf_counter() - t0 < 5


# ---- R2-12: meta tensors ---------------------------------------------------------------------------------------


def test_meta_tensors_propagate_shapes_for_every_method():
    from positional_lsh import PositionalLSHAttention, plsh_attention

    q = torch.empty(2, 4, 8, 16, device="meta", requires_grad=True)
    k = torch.empty(2, 2, 12, 16, device="meta", requires_grad=True)
    for method in ("auto", "samples", "multiplicity"):
        out = plsh_attention(q, k, k, num_samples=4, method=method)
        assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape and k.grad.shape == k.shape
        module = PositionalLSHAttention(4, num_samples=4, method=method)
        assert module(q, k, k).shape == q.shape


# ---- R2-14, R2-16: messages that name the file or flag -----------------------------------------------------------


def test_a_binary_tokenizer_is_named(run: Path, text_dir: Path, tmp_path: Path, capsys):
    binary = tmp_path / "tokenizer.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    refused(["eval", str(run), "--data", str(text_dir), "--tokenizer", str(binary), "--factors", "1", "--samples",
             "none", "--no-progress"], capsys, run, tmp_path, match=str(binary))  # fmt: skip


def test_train_on_tiny_files_names_the_data_and_the_flag(tokenizer_file: Path, tmp_path: Path, capsys):
    tiny_dir = tmp_path / "tiny"
    tiny_dir.mkdir()
    for i in range(4):
        (tiny_dir / f"t{i}.txt").write_text(f"tiny text {i}.\n")
    err = refused(tiny(tmp_path / "run", tiny_dir, tokenizer_file), capsys, tiny_dir, match=f"--data {tiny_dir}")
    assert "--seq-len 32" in err and "tokens" in err


# ---- R2-15: sample_partitions messages that name the problem -----------------------------------------------------


def test_sample_partitions_messages_name_the_problem():
    from positional_lsh import register_scheme, sample_partitions, unregister_scheme

    cases = [
        (dict(slopes=[]), ValueError, "slopes must have at least one entry"),
        (dict(slopes=torch.ones(2, 3)), ValueError, r"slopes must be a 1-D tensor.*\(2, 3\)"),
        (dict(slopes=None, num_heads=2, decay="exp"), TypeError, "decay must be a Decay.*'exp'"),
        (dict(slopes=None, num_heads=1, decay=lambda d: "far"), TypeError, "decay callable must return numbers"),
        (dict(slopes=[0.5], generator=2**64), ValueError, r"generator seed must be in \[0, 2\*\*64\)"),
        (dict(slopes=[0.5], max_block=10**400), ValueError, "max_block must be <= 2\\*\\*53.*401 digits"),
        (dict(slopes=[0.5, 0.2], scheme="wrong-shape"), ValueError, r"sampler of scheme 'wrong-shape'.*shape \(3,\)"),
    ]
    register_scheme("wrong-shape", lambda m, t, g: (torch.ones(t), torch.zeros(t)), unbiased=False, integer=False)
    try:
        for kw, exc, match in cases:
            with pytest.raises(exc, match=match):
                sample_partitions(16, num_samples=3, **kw)
    finally:
        unregister_scheme("wrong-shape")


# ---- R2-17: nonsense accepted silently ---------------------------------------------------------------------------


def test_nonsense_flags_are_refused(tmp_path: Path, capsys):
    val = ["validate", "--out", str(tmp_path / "val")]
    refused([*val, "--threads", "-1"], capsys, tmp_path, match="threads must be >= 1")
    parser_refused([*val, "--max-work", "nan"], capsys, match="--max-work")
    binary = tmp_path / "ls"
    binary.write_bytes(b"\x7fELF\x00\x00" * 50)
    refused([*val, "--text", str(binary), "--seq-lens", "64", "--samples", "1", "--lengths", "none",
             "--compare-samples", "0", "--unbiasedness-replicates", "0", "--report-adversarial-lengths", "none",
             "--no-plots", "--quiet"], capsys, tmp_path, match=str(binary))  # fmt: skip
    assert not (tmp_path / "val").exists()
    refused(["bench", "--lengths", "", "--out", str(tmp_path / "b")], capsys, tmp_path, match="lengths")
    refused(["bench", "--lengths", "64", "--out", ""], capsys, tmp_path, match="--out")
    for argv, flag in ((["eval", "--stride", "x"], "--stride"), (["eval", "--schemes", "nope"], "--schemes"),
                       (["bench", "--heads", "x"], "--heads")):  # fmt: skip
        err = parser_refused(argv, capsys, match=f"argument {flag}")
        assert "_text" not in err and "invalid <" not in err and "usage:" not in err, err
