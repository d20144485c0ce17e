"""Learned ALiBi slopes in the language model (``ModelConfig.learn_slopes``) and ``plsh train --learn-slopes``.

The gradients of the log-slopes are checked against dense float64 autograd through an explicit ``n x n`` bias
(exact ALiBi, windowed ALiBi) and against the dense surrogate reference of positional LSH
``softmax(s + log Mbar - (m - m.detach())[h] |i - j|) v`` for the same partitions; training, exact resume, the
log, ``plsh eval``'s slopes table and ``slopes.csv``, and the refused combinations (one line, exit 2) end to end.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from positional_lsh.cli import eval as cli_eval
from positional_lsh.cli import train as cli_train
from positional_lsh.lm import ModelConfig, TransformerLM, load_checkpoint
from positional_lsh.lm import train_loop as L
from positional_lsh.lm.eval_models import LMAdapter
from positional_lsh.lm.eval_results import LearnedSlopes, format_slopes, read_slopes, write_slopes

from conftest import TINY_LM as TINY
from conftest import lm_ids as ids
from conftest import naive_mean_mask
from conftest import tiny_lm as tiny


def log_slopes(model: TransformerLM) -> list[torch.nn.Parameter]:
    return [block.attn.log_slopes for block in model.blocks]


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"position": "rope", "learn_slopes": True}, ValueError, "learn_slopes.*rope"),
        ({"position": "nope", "learn_slopes": True}, ValueError, "learn_slopes.*nope"),
        ({"position": "alibi", "sigma": math.inf, "learn_slopes": True}, ValueError, "learn_slopes.*sigma=inf"),
        ({"position": "plsh", "learn_slopes": 1}, TypeError, "learn_slopes must be a bool"),
    ],
)
def test_config_refuses_what_cannot_be_learned(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        ModelConfig(**{**TINY, **kw})


def test_describe_says_learned() -> None:
    assert ModelConfig(position="alibi", learn_slopes=True).describe() == "alibi, learned slopes"
    assert ModelConfig(position="plsh", num_samples=4, learn_slopes=True).describe() == (
        "plsh T=4 discrete, learned slopes"
    )
    assert ModelConfig(position="alibi").describe() == "alibi"


# --------------------------------------------------------------------------------------------------
# No existing number changes when slopes are not learned
# --------------------------------------------------------------------------------------------------

# Computed with the code before learned slopes existed (same seeds): logits[0, -1, :3], the loss and the norm of
# blocks.0.attn.qkv.weight's gradient of tiny(position, **kw).train() on ids(), targets ids rolled by one.
BEFORE = [
    ("alibi", {"alibi_impl": "sdpa"}, [-0.062261, -0.067396, 0.009979], 4.563528, 0.1310265),
    ("alibi", {"alibi_impl": "chunked"}, [-0.062261, -0.067396, 0.009979], 4.563528, 0.1310265),
    ("window-alibi", {"window_factor": 2.0}, [-0.061843, -0.068112, 0.009064], 4.56357, 0.131696),
    ("window-alibi", {"window": 5.0, "alibi_impl": "chunked"}, [-0.054197, -0.077395, -0.004439], 4.563204, 0.1478306),
    ("plsh", {"num_samples": 3}, [-0.061589, -0.067354, 0.012114], 4.563704, 0.132434),
    ("rope", {}, [-0.06637, -0.064406, 0.010315], 4.563395, 0.1316704),
]
LAYER_KEYS = ("norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight", "mlp.fc.weight", "mlp.proj.weight")
KEYS = ["embed.weight"] + [f"blocks.{i}.{n}" for i in range(2) for n in LAYER_KEYS] + ["norm.weight", "head.weight"]


@pytest.mark.parametrize(("position", "kw", "logits", "loss", "grad_norm"), BEFORE)
def test_no_existing_number_changes_without_learned_slopes(position, kw, logits, loss, grad_norm) -> None:
    model = tiny(position, **kw).train()
    assert list(model.state_dict()) == KEYS and all(b.attn.log_slopes is None for b in model.blocks)
    x = ids()
    out, value = model(x, torch.roll(x, -1, dims=1))
    value.backward()
    torch.testing.assert_close(out[0, -1, :3].tolist(), logits, rtol=0, atol=2e-6)
    assert value.item() == pytest.approx(loss, abs=2e-6)
    assert model.blocks[0].attn.qkv.weight.grad.norm().item() == pytest.approx(grad_norm, abs=2e-7)


@pytest.mark.parametrize(
    ("position", "kw"),
    [("alibi", {"alibi_impl": "sdpa"}), ("alibi", {"alibi_impl": "chunked"}), ("window-alibi", {"window_factor": 2.0}),
     ("window-alibi", {"window_factor": 2.0, "alibi_impl": "chunked"}), ("plsh", {"num_samples": 3})],
)  # fmt: skip
def test_learned_slopes_start_as_the_fixed_model(position: str, kw: dict) -> None:
    # Same weights (the log-slopes draw no random numbers), same outputs and same gradients at the start.
    fixed, learned = tiny(position, **kw).train(), tiny(position, learn_slopes=True, **kw).train()
    extra = sorted(set(learned.state_dict()) - set(fixed.state_dict()))
    assert extra == ["blocks.0.attn.log_slopes", "blocks.1.attn.log_slopes"]
    for p in log_slopes(learned):
        assert p.dtype == torch.float32 and p.requires_grad
        torch.testing.assert_close(p.detach().exp().double(), learned.cfg.slopes(), rtol=1e-6, atol=0)
    x = ids()
    a, la = fixed(x, torch.roll(x, -1, dims=1))
    b, lb = learned(x, torch.roll(x, -1, dims=1))
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    la.backward(), lb.backward()
    grads = dict(learned.named_parameters())
    for name, p in fixed.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in log_slopes(learned))


# --------------------------------------------------------------------------------------------------
# Gradients against dense float64 references
# --------------------------------------------------------------------------------------------------


def dense_exact(q, k, v, m, window):
    """softmax(q k^T / sqrt(d) - m_h |i - j|) v with the causal and window masks as an explicit n x n bias."""
    n = q.shape[2]
    i = torch.arange(n, dtype=torch.float64)
    dist = i[:, None] - i[None, :]
    drop = (dist < 0)[None].expand(q.shape[1], n, n)
    if window is not None:
        drop = drop | (dist.abs()[None] > window[:, None, None])
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) - m[:, None, None] * dist.abs()
    return torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1) @ v


def dense_surrogate(q, k, v, m, mbar):
    """The estimator softmax(s + log Mbar) v, whose m-gradient is the surrogate -sum dS_hat |i - j| (contract)."""
    n = q.shape[2]
    i = torch.arange(n, dtype=torch.float64)
    dist = i[:, None] - i[None, :]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mbar.log() - (m - m.detach())[:, None, None] * dist.abs()
    return torch.softmax(s.masked_fill(dist < 0, float("-inf")), dim=-1) @ v


def reference_loss(model: TransformerLM, x: torch.Tensor, attention) -> torch.Tensor:
    """The model's loss with each layer's attention replaced by ``attention(layer, q, k, v, slopes)``."""
    cfg = model.cfg
    h = model.embed(x)
    for block in model.blocks:
        a = block.attn
        z = block.norm1(h)
        b, n, c = z.shape
        q, k, v = a.qkv(z).view(b, n, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
        y = attention(a, q, k, v, a.log_slopes.exp())
        h = h + a.proj(y.transpose(1, 2).reshape(b, n, c))
        h = h + block.mlp(block.norm2(h))
    logits = model.head(model.norm(h))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def check_against(model: TransformerLM, attention, x: torch.Tensor) -> None:
    h = model.embed(x)
    for block in model.blocks:  # the model's own layers (its forward rounds the logits to float32 at the end)
        h, _ = block(h)
    logits = model.head(model.norm(h))
    F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    got = [p.grad.clone() for p in log_slopes(model)]
    want = torch.autograd.grad(reference_loss(model, x, attention), log_slopes(model))
    for g, w in zip(got, want, strict=True):
        assert w.abs().max() > 1e-5  # the slopes matter here
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def perturbed(model: TransformerLM) -> TransformerLM:
    """Slopes moved off their start (per layer and head), so that a test sees the learned values in use."""
    with torch.no_grad():
        for i, p in enumerate(log_slopes(model)):
            p.add_(torch.linspace(-0.5, 0.7, p.numel(), dtype=p.dtype) * (1 + i))
    return model


@pytest.mark.parametrize("impl", ["sdpa", "chunked"])
def test_alibi_slope_gradient_equals_dense_autograd(impl: str) -> None:
    model = perturbed(tiny("alibi", alibi_impl=impl, learn_slopes=True).double())
    check_against(model, lambda a, q, k, v, m: dense_exact(q, k, v, m, None), ids())


@pytest.mark.parametrize("impl", ["sdpa", "chunked"])
def test_window_alibi_window_follows_the_slopes_and_gradient_equals_dense(impl: str) -> None:
    model = perturbed(tiny("window-alibi", alibi_impl=impl, window_factor=2.0, learn_slopes=True).double())
    for a in (b.attn for b in model.blocks):  # window = window_factor / m_h of the current slopes
        torch.testing.assert_close(a.current_window(), 2.0 / a.log_slopes.detach().exp())
        assert (a.current_window() < 23).any()  # the window cuts at 24 tokens

    def reference(a, q, k, v, m):
        return dense_exact(q, k, v, m, 2.0 / m.detach())

    check_against(model, reference, ids())
    torch.testing.assert_close(model.windows(), torch.stack([2.0 / p.detach().exp() for p in log_slopes(model)]))


def test_a_fixed_window_stays_fixed() -> None:
    model = perturbed(tiny("window-alibi", window=5.0, learn_slopes=True).double())
    assert torch.equal(model.windows(), torch.full((2, 4), 5.0, dtype=torch.float64))
    five = torch.full((4,), 5.0, dtype=torch.float64)
    check_against(model, lambda a, q, k, v, m: dense_exact(q, k, v, m, five), ids())


def test_plsh_slope_gradient_equals_the_dense_surrogate_for_the_same_partitions() -> None:
    model = perturbed(tiny("plsh", num_samples=3, learn_slopes=True).double()).eval()  # eval: fixed partitions
    x = ids()

    def reference(a, q, k, v, m):
        parts = a.partitions(q.shape[2])
        torch.testing.assert_close(parts.slopes, m.detach())  # drawn from the learned slopes
        return dense_surrogate(q, k, v, m, naive_mean_mask(parts.pitch, parts.shift, q.shape[2]))

    check_against(model, reference, x)


# --------------------------------------------------------------------------------------------------
# The model around the slopes: set_position, eval adapter, optimizer, compile, context parallelism
# --------------------------------------------------------------------------------------------------


def test_set_position_keeps_the_learned_slopes() -> None:
    model = perturbed(tiny("alibi", learn_slopes=True)).eval()
    learned = model.learned_slopes()
    assert learned.shape == (2, 4) and not torch.allclose(learned[0], model.cfg.slopes())
    model.set_position("plsh", num_samples=4)
    for layer, block in enumerate(model.blocks):
        torch.testing.assert_close(block.attn.partitions(24).slopes, learned[layer])
    model.set_position("window-alibi")
    torch.testing.assert_close(model.windows(), 12.0 / learned)
    assert torch.equal(model.learned_slopes(), learned)
    with pytest.raises(ValueError, match="sigma cannot change"):
        model.set_position("alibi", sigma=8.0)
    with pytest.raises(ValueError, match="learn_slopes"):
        model.set_position("rope")


@pytest.mark.parametrize("position", ["alibi", "window-alibi", "plsh"])
def test_decoding_with_a_cache_equals_recomputation(position: str) -> None:
    # Queries after cached keys (Lq < Lk): the learned bias and window use the right positions.
    model = perturbed(tiny(position, num_samples=2, window_factor=2.0, learn_slopes=True)).eval()
    x = ids(1, 20)
    logits, cache = model.forward_with_cache(x[:, :6])
    steps = [logits]
    for t in range(6, 20):
        logits, cache = model.forward_with_cache(x[:, t : t + 1], cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), model(x), rtol=1e-5, atol=1e-5)


def test_eval_adapter_uses_the_learned_slopes() -> None:
    model = perturbed(tiny("alibi", learn_slopes=True)).eval()
    adapter = LMAdapter(model, "m")
    learned = model.learned_slopes()
    assert torch.equal(adapter.slopes, learned.reshape(-1)) and adapter.num_heads == 4
    assert adapter.learned == LearnedSlopes("m", learned.tolist(), model.cfg.slopes().tolist())
    windows = torch.arange(8, dtype=torch.float64) + 3  # one equal-cost window per layer and head
    adapter.set_attention("window", window=windows)
    assert torch.equal(model.windows(), windows.reshape(2, 4))
    adapter.reset()
    assert model.cfg.position == "alibi" and torch.equal(model.learned_slopes(), learned)
    assert LMAdapter(tiny("alibi"), "fixed").learned is None


def test_log_slopes_get_no_weight_decay() -> None:
    model = tiny("plsh", learn_slopes=True)
    cfg = type("Cfg", (), {"weight_decay": 0.1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95})()
    opt = L.adamw(model.parameters(), cfg, torch.device("cpu"))
    ids_of = {id(p) for p in log_slopes(model)}
    decayed = [g for g in opt.param_groups if g["weight_decay"] > 0]
    assert decayed and not any(id(p) in ids_of for g in decayed for p in g["params"])
    assert sum(id(p) in ids_of for g in opt.param_groups for p in g["params"]) == 2


@pytest.mark.parametrize(
    ("position", "backend"),
    [("alibi", "aot_eager"), ("window-alibi", "aot_eager"), ("plsh", "aot_eager"),
     pytest.param("alibi", "inductor", marks=pytest.mark.slow), pytest.param("window-alibi", "inductor",
                                                                             marks=pytest.mark.slow)],
)  # fmt: skip
def test_compiled_model_learns_the_slopes_like_eager(position: str, backend: str) -> None:
    # fullgraph tracing and the compiled autograd graph (aot_eager: fast; inductor's code generation: slow only)
    torch._dynamo.reset()
    x = ids(2, 24)
    eager, comp = (tiny(position, window_factor=2.0, learn_slopes=True) for _ in range(2))
    compiled = torch.compile(comp, fullgraph=True, backend=backend)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, comp)]
    for _ in range(2):
        for fn, opt in zip((eager, compiled), opts, strict=True):
            loss = F.cross_entropy(fn(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not torch.allclose(eager.learned_slopes(), eager.cfg.slopes().expand(2, 4))
    torch.testing.assert_close(comp.learned_slopes(), eager.learned_slopes(), rtol=1e-5, atol=1e-7)


def test_compiled_plsh_checks_the_slopes_against_the_partitions_inside_the_op() -> None:
    # Under torch.compile, slopes= with partitions= cannot be compared at trace time: the compiled op compares them
    # on the data when it runs, so a mismatch is refused there too (eager: check_slopes_match).
    from positional_lsh.ops.attention import plsh_attention
    from positional_lsh.ops.partitions.partition import sample_partitions

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 32, 8, generator=g) for _ in range(3))
    drawn = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    parts = sample_partitions(32, drawn.double(), 2, generator=0)

    def call(slopes: torch.Tensor) -> torch.Tensor:
        return plsh_attention(q, k, v, slopes, partitions=parts)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    learnable = drawn.clone().requires_grad_()
    out = compiled(learnable)
    out.sum().backward()
    ref = drawn.clone().requires_grad_()
    call(ref).sum().backward()
    torch.testing.assert_close(out, call(drawn), rtol=0, atol=0)
    torch.testing.assert_close(learnable.grad, ref.grad, rtol=1e-6, atol=1e-7)
    for wrong in (drawn * 2, (drawn * 2).requires_grad_()):
        with pytest.raises(ValueError, match=r"slopes differ from partitions\.slopes"):
            compiled(wrong)
        with pytest.raises(ValueError, match=r"slopes differ from partitions\.slopes"):
            call(wrong)


def test_context_parallel_layer_refuses_learned_slopes() -> None:
    from positional_lsh.distributed import ContextShards

    model = tiny("plsh", learn_slopes=True)
    with pytest.raises(ValueError, match=r"learn_slopes.*context parallelism"):
        model(ids(), context=ContextShards(None, shard_lengths=[24]))


def test_checkpoint_round_trip_keeps_the_slopes(tmp_path: Path) -> None:
    from positional_lsh.lm.checkpoint import save_checkpoint
    from positional_lsh.ops.errors import UserError

    model = perturbed(tiny("alibi", learn_slopes=True))
    save_checkpoint(tmp_path / "ck", model, dtype="bfloat16")  # the log-slopes are stored unrounded
    loaded = load_checkpoint(tmp_path / "ck", position="plsh", num_samples=2).model
    assert loaded.cfg.learn_slopes and torch.equal(loaded.learned_slopes(), model.learned_slopes())
    assert not torch.equal(loaded.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)  # rounded
    with pytest.raises(UserError, match="learn_slopes=True is part of the weights"):
        load_checkpoint(tmp_path / "ck", learn_slopes=False)
    with pytest.raises(UserError, match="sigma"):
        load_checkpoint(tmp_path / "ck", sigma=8.0)


def test_slopes_table_and_csv_round_trip(tmp_path: Path) -> None:
    ls = LearnedSlopes("m", [[0.5, 0.25], [0.125, 1.0]], [0.25, 0.0625])
    text = format_slopes(ls)
    assert text.splitlines()[1:] == ["| layer | h0 | h1 |", "|---|---:|---:|", "| start | 0.25 | 0.0625 |",
                                     "| 0 | 0.5 | 0.25 |", "| 1 | 0.125 | 1 |"]  # fmt: skip
    assert read_slopes(write_slopes([ls], tmp_path / "slopes.csv")) == [ls]


# --------------------------------------------------------------------------------------------------
# plsh train --learn-slopes, resume, plsh eval
# --------------------------------------------------------------------------------------------------


# text_dir, tokenizer_file: tests/conftest.py


def train_args(out: Path, text_dir: Path, tok: Path, position: str, *more: str) -> list[str]:
    return ["--out", str(out), "--data", str(text_dir), "--tokenizer", str(tok), "--cache-dir", "", "--seq-len", "32",
            "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--position", position, "--num-samples", "2",
            "--batch-size", "4", "--steps", "6", "--warmup", "2", "--lr", "3e-2", "--eval-interval", "3",
            "--eval-batches", "2", "--autocast", "float32", "--no-progress", *more]  # fmt: skip


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("position", ["alibi", "plsh"])
def test_train_learns_slopes_logs_them_and_resumes_exactly(
    position: str, tmp_path: Path, text_dir: Path, tokenizer_file: Path
) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    assert cli_train.main(train_args(full, text_dir, tokenizer_file, position, "--learn-slopes")) == 0
    ck = load_checkpoint(full)
    assert ck.model.cfg.learn_slopes and ck.metadata["train_config"]["weight_decay"] == 0.1
    learned = ck.model.learned_slopes()
    start = ck.model.cfg.slopes().expand(2, 2)
    assert not torch.allclose(learned, start, rtol=1e-3)  # the slopes moved
    vals = [r for r in read_log(full) if "val_loss" in r]
    assert [r["step"] for r in vals] == [3, 6] and all(len(r["slopes"]) == 2 and len(r["slopes"][0]) == 2 for r in vals)
    torch.testing.assert_close(torch.tensor(vals[-1]["slopes"], dtype=torch.float64), learned, rtol=1e-5, atol=0)
    # stopped at step 4 and resumed: the same weights, slopes and log as the uninterrupted run
    assert cli_train.main(train_args(split, text_dir, tokenizer_file, position, "--learn-slopes", "--stop-after",
                                     "4")) == 0  # fmt: skip
    assert cli_train.main(["--out", str(split), "--resume", "--no-progress"]) == 0
    wf, ws = load_checkpoint(full).model.state_dict(), load_checkpoint(split).model.state_dict()
    assert wf.keys() == ws.keys() and all(torch.equal(wf[k], ws[k]) for k in wf)
    assert [r.get("slopes") for r in read_log(full)] == [r.get("slopes") for r in read_log(split)]


def test_eval_shows_and_writes_the_learned_slopes(
    tmp_path: Path, text_dir: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert cli_train.main(train_args(run, text_dir, tokenizer_file, "alibi", "--learn-slopes", "--steps", "3")) == 0
    capsys.readouterr()
    out = tmp_path / "eval"
    argv = [str(run), "--factors", "1,2", "--samples", "2", "--schemes", "discrete", "--max-tokens", "300",
            "--cache-dir", "", "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli_eval.main(argv) == 0
    printed = capsys.readouterr().out
    learned = load_checkpoint(run).model.learned_slopes()
    assert "learned slopes of run" in printed and "| layer | h0 | h1 |" in printed
    with open(out / "slopes.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    assert [(int(r["layer"]), int(r["head"])) for r in recs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    torch.testing.assert_close(torch.tensor([float(r["slope"]) for r in recs], dtype=torch.float64),
                               learned.reshape(-1), rtol=1e-12, atol=0)  # fmt: skip
    assert "learned slopes of run" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--position", "rope", "--learn-slopes"], "learn_slopes=True needs position"),
        (["--position", "alibi", "--sigma", "inf", "--learn-slopes"], "slope 0 has no logarithm"),
        (["--position", "plsh", "--learn-slopes", "--context-parallel", "2"], "--learn-slopes .*--context-parallel 2"),
    ],
)
def test_cli_refuses_bad_combinations(
    extra: list[str], match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bad"
    assert cli_train.main(["--out", str(out), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(match, err), err
    assert not out.exists()  # nothing on disk changed


def test_resume_refuses_a_learn_slopes_mismatch(
    tmp_path: Path, text_dir: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert cli_train.main(train_args(run, text_dir, tokenizer_file, "alibi", "--steps", "2", "--stop-after", "1")) == 0
    before = sorted(p.name for p in run.rglob("*"))
    capsys.readouterr()
    assert cli_train.main(["--out", str(run), "--resume", "--learn-slopes", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--learn-slopes True conflicts with the run's False" in err, err
    assert sorted(p.name for p in run.rglob("*")) == before


def test_native_slopes_of_a_learned_model_are_the_learned_ones_or_refused():
    """``native_slopes`` (capture, validate, the swap) reads the slopes a learned-slopes model uses now: shared by
    every layer, they are returned; different per layer, there is no one answer and it refuses (never the starting
    slopes in silence)."""
    from positional_lsh.integrations.families import native_slopes
    from positional_lsh.ops.errors import UserError

    model = TransformerLM(ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, seq_len=32, learn_slopes=True))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.log_slopes.add_(0.5)
    shared = native_slopes(model)
    assert shared is not None
    torch.testing.assert_close(shared, model.slopes()[0], rtol=0, atol=0)
    assert not torch.allclose(shared, model.cfg.slopes())
    with torch.no_grad():
        model.blocks[1].attn.log_slopes.add_(0.1)
    with pytest.raises(UserError, match="different slopes in each layer"):
        native_slopes(model)
