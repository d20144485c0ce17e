"""Nothing silent, nothing lost: refusals, one-line errors, atomic checkpoint sets, signals and kills.

Every case of docs/reliability.md has its test here. Models are tiny and runs a few steps, so the whole file
takes well under two minutes on two cores.
"""

from __future__ import annotations

import hashlib
import json
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
    torch.set_num_threads(2)
    try:
        assert cli.main([*base[:3], "--resume", "--steps", "5", "--no-progress"]) == 0
        assert torch.get_num_threads() == 1  # the run's thread count, restored
    finally:
        torch.set_num_threads(int(os.environ.get("PLSH_TEST_THREADS", "2")))
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
