"""Shared test helpers: independent, deliberately naive references written from the definitions."""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from positional_lsh.lm import TransformerLM

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when positional_lsh.ops._engine.triton.host is
# first imported (tests/test_architecture.py imports every documented module, before tests/ops/engine/test_triton.py
# runs).
# Without a GPU the kernels can only run in Triton's CPU interpreter, so set it here, before anything imports them
# (importing torch does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)  # tiny tensors: one thread avoids OpenMP hand-off costs on a busy machine


def naive_mean_mask(pitch: torch.Tensor, shift: torch.Tensor, n: int) -> torch.Tensor:
    """Mbar[h, i, j] from the definition: positions i, j share block floor((i - shift) / pitch)."""
    t_count, h_count = pitch.shape
    out = torch.zeros(h_count, n, n, dtype=torch.float64)
    for t in range(t_count):
        for h in range(h_count):
            b, s = float(pitch[t, h]), float(shift[t, h])
            lab = [0 if math.isinf(b) else math.floor((i - s) / b) for i in range(n)]
            for i in range(n):
                for j in range(n):
                    out[h, i, j] += lab[i] == lab[j]
    return out / t_count


def naive_estimator(q, k, v, mbar, *, causal: bool, scale: float | None = None) -> torch.Tensor:
    """out_i = sum_j Mbar e^{s} v_j / sum_j Mbar e^{s}, queries aligned to the last keys, float64."""
    q, k, v = q.double(), k.double(), v.double()
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, hq, lq, d, dtype=torch.float64)
    for h in range(hq):
        hk = h // (hq // hkv)
        for r in range(lq):
            i = lk - lq + r
            s = (k[:, hk] @ q[:, h, r].unsqueeze(-1)).squeeze(-1) * sc  # (b, lk)
            w = mbar[h, i].expand(b, lk).clone()
            if causal:
                w[:, i + 1 :] = 0
            m = s.max(dim=-1, keepdim=True).values
            e = w * torch.exp(s - m)
            out[:, h, r] = (e.unsqueeze(-1) * v[:, hk]).sum(1) / e.sum(-1, keepdim=True)
    return out


def dense_surrogate(q, k, v, dout, mbar, *, causal, scale):
    """float64 ``(out, dq, dk, dv, dist)`` by autograd through ``softmax(s + log Mbar - (m - m.detach()) |i - j|) v``
    (``Mbar (Hq, Lk, Lk)``; queries the last ``Lq`` positions): the estimator and its gradients, ``dist = -dm``."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    hq, hkv, lq, lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    pos = torch.arange(lk - lq, lk)
    dist = (pos[:, None] - torch.arange(lk)[None, :]).abs().double()
    log_mbar = torch.log(mbar[:, lk - lq :, :])
    if causal:
        log_mbar = log_mbar.masked_fill(torch.arange(lk)[None, :] > pos[:, None], -math.inf)
    m = torch.zeros(hq, dtype=torch.float64, requires_grad=True)
    kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = q @ kk.transpose(-1, -2) * scale + log_mbar - (m - m.detach())[:, None, None] * dist
    out = torch.softmax(s, -1) @ vv
    dq, dk, dv, dm = torch.autograd.grad(out, (q, k, v, m), dout.double())
    return out.detach(), dq, dk, dv, -dm


def naive_alibi(q, k, v, slopes, *, causal: bool, window=None, scale: float | None = None) -> torch.Tensor:
    """Exact ALiBi by an explicit n x n bias built with Python loops (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    _, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    bias = torch.zeros(hq, lq, lk, dtype=torch.float64)
    for h in range(hq):
        for r in range(lq):
            i = lk - lq + r
            for j in range(lk):
                dist = abs(i - j)
                keep = (not causal or j <= i) and (window is None or dist <= float(window[h]))
                bias[h, r, j] = -float(slopes[h]) * dist if keep else -math.inf
    group = hq // hkv
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    s = q @ kk.transpose(-1, -2) * sc + bias
    return torch.softmax(s, dim=-1) @ vv


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module's tests, the previous count restored after it (many small float64 ops: one
    thread is much faster, above all on a shared machine). Use: ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from ``/proc``; none where it does not exist)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_torchrun(
    cmd: list[str], env: dict[str, str], done: str | None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a ``torch.distributed.run`` command line, its output captured.

    A run still alive after ``timeout`` seconds gets ``SIGABRT``, the agent and every process below it, with
    Python's ``faulthandler`` on, so that each prints the stack of each of its threads to the captured stderr.
    If ``done`` is given and its stdout already holds it (the line a run prints after its last checkpoint is
    written), the work is complete and only the exit hung: the stacks are reported as a warning and the run is
    returned as finished (exit 0), for the test to check what it wrote. Otherwise the test fails, with the stacks.
    """
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        pids = [proc.pid, *_descendants(proc.pid)]  # the ranks run in sessions of their own: found before any dies
        _signal_all(pids, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            _signal_all(pids, signal.SIGKILL)
            out, err = proc.communicate()
    if done is not None and done in out:
        warnings.warn(f"torchrun finished its work but did not exit within {timeout:.0f} s; the stacks at SIGABRT:\n"
                      f"{err[-8000:]}", stacklevel=2)  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, out, err)
    pytest.fail(f"torchrun did not finish within {timeout:.0f} s\n{out[-3000:]}\n{err[-8000:]}")


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV file with a header, as dicts."""
    with open(path) as fh:
        return list(csv.DictReader(fh))


TINY_LM = {"vocab_size": 97, "seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 32}
"""A tiny language model's settings (``ModelConfig`` fields; the position mode comes with :func:`tiny_lm`)."""


def tiny_lm(position: str = "alibi", **kw: object) -> TransformerLM:
    """A :data:`TINY_LM` ``TransformerLM`` in ``position`` mode (other ``ModelConfig`` fields from ``kw``), its
    weights from ``torch.manual_seed(0)``."""
    from positional_lsh.lm import ModelConfig, TransformerLM

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**TINY_LM, "position": position, **kw}))  # type: ignore[arg-type]


def lm_ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    """``(batch, length)`` random token ids below :data:`TINY_LM`'s vocabulary, seeded with ``seed``."""
    return torch.randint(0, TINY_LM["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def corpus_dir(root: Path, chars: int) -> Path:
    """Ten documents of the shipped corpus cut at ``chars`` characters (enough for train/validation/test splits),
    written into ``root`` as ``docNN.txt``."""
    from positional_lsh.lm import data as D

    docs = D.load_corpus()
    for i, d in enumerate(docs[:4] + docs[20:26]):
        (root / f"doc{i:02d}.txt").write_text(d.text[:chars], encoding="utf-8")
    return root


def bpe_file(texts: Path, out: Path) -> Path:
    """A 300-token BPE tokenizer trained on ``texts``' training split, saved as ``out/tokenizer.json``."""
    from positional_lsh.lm import data as D

    splits = D.load_splits(str(texts))
    return D.train_tokenizer(splits["train"], 300).save(out / "tokenizer.json")


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped corpus cut at 6,000 characters a document (:func:`corpus_dir`), once per module. A module that
    needs another corpus defines its own ``text_dir``."""
    return corpus_dir(tmp_path_factory.mktemp("texts"), 6000)


@pytest.fixture(scope="module")
def tokenizer_file(text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token BPE tokenizer trained on ``text_dir``'s training split, saved as ``tokenizer.json``."""
    return bpe_file(text_dir, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``plsh train-hf`` tests' corpus: the shipped corpus cut at 5,000 characters a document."""
    return corpus_dir(tmp_path_factory.mktemp("hf-texts"), 5000)


@pytest.fixture(scope="module")
def tok_file(hf_text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 300-token BPE trained on ``hf_text_dir``'s training split (nothing is downloaded)."""
    return bpe_file(hf_text_dir, tmp_path_factory.mktemp("hf-tok"))


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (``PLSH_CPU_KERNEL=0``): for the tests of torch's kernels and of their routing, which the CPU
    kernel (ops/_engine/cpu/, the default on the CPU where it builds) would otherwise take over. Use:
    ``pytestmark = pytest.mark.usefixtures("torch_path")`` or a test's argument."""
    monkeypatch.setenv("PLSH_CPU_KERNEL", "0")
