"""Tests for positional_lsh.lm.evaluate: sliding-window metrics vs direct computation, cost accounting, the
checkpoint and transformers paths of ``plsh eval``, outputs, the shipped model demo, bad input."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from positional_lsh.cli import eval as cli_eval
from positional_lsh.lm import ModelConfig, TransformerLM, save_checkpoint
from positional_lsh.lm import data as D
from positional_lsh.lm import evaluate as E
from positional_lsh.ops.partitions.partition import sample_partitions
from positional_lsh.ops.partitions.slopes import alibi_slopes


def toy_model(vocab: int = 50, position: str = "alibi") -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, seq_len=8, n_layer=2, n_head=4, d_model=32, position=position)
    return TransformerLM(cfg).eval()


def direct_metrics(model: TransformerLM, tokens: torch.Tensor, seq_len: int, stride: int) -> dict[str, float]:
    """The protocol from its definition: windows start at 0, stride, 2*stride, ... (plus one ending at the last
    token); token i is scored by the first window that reaches it, from the tokens of that window before it
    (the model's plain forward on them), at position ``i - 1 - w`` of the window starting at ``w``."""
    n = tokens.numel()
    starts = list(range(0, n - 1 - seq_len + 1, stride))
    if starts[-1] != n - 1 - seq_len:
        starts.append(n - 1 - seq_len)
    nll, top1, top10, rr, entropy = 0.0, 0, 0, 0.0, 0.0
    pos_nll, pos_count = [0.0] * seq_len, [0] * seq_len
    with torch.no_grad():
        for i in range(1, n):
            w = next(s for s in starts if s + seq_len >= i)
            logits = model(tokens[w:i][None])[0, -1].double()
            loss = -float(torch.log_softmax(logits, -1)[tokens[i]])
            nll += loss
            pos_nll[i - 1 - w] += loss
            pos_count[i - 1 - w] += 1
            order = logits.argsort(descending=True)
            top1 += int(order[0] == tokens[i])
            top10 += int(tokens[i] in order[:10])
            values = logits.tolist()
            rr += 1 / (1 + sum(v > values[int(tokens[i])] for v in values))  # rank: strictly larger logits
            z = max(values)
            log_z = z + math.log(sum(math.exp(v - z) for v in values))
            entropy -= sum(math.exp(v - log_z) * (v - log_z) for v in values)
    count = n - 1
    return {"loss": nll / count, "top1": top1 / count, "top10": top10 / count, "mrr": rr / count,
            "entropy": entropy / count, "position_nll": pos_nll, "position_count": pos_count}  # fmt: skip


@pytest.mark.parametrize(("seq_len", "stride"), [(8, 8), (8, 3), (8, 1), (5, 2)])
def test_sliding_window_metrics_equal_direct_computation(seq_len: int, stride: int) -> None:
    model = toy_model()
    tokens = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(2))
    got = E.sliding_window_metrics(model, tokens, seq_len, stride, batch_size=3)
    ref = direct_metrics(model, tokens, seq_len, stride)
    assert got["tokens"] == 39 and got["windows"] == D.num_sliding_windows(40, seq_len, stride)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["top1"] == ref["top1"] and got["top10"] == ref["top10"]
    assert got["mrr"] == pytest.approx(ref["mrr"], rel=1e-6)
    assert got["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    assert got["position_count"] == ref["position_count"]
    assert got["position_nll"] == pytest.approx(ref["position_nll"], rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(got["loss"]))
    assert got["bits_per_token"] == pytest.approx(got["loss"] / math.log(2))


def test_metrics_of_a_bigram_table() -> None:
    """A context-free model: the metrics are those of scoring every token once from its predecessor."""
    table = torch.randn(20, 20, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 20, (101,), generator=torch.Generator().manual_seed(1))
    got = E.sliding_window_metrics(lambda x: table[x], tokens, 16, 5, batch_size=4)
    logp = torch.log_softmax(table[tokens[:-1]], -1)
    nll = -logp.gather(1, tokens[1:, None]).mean()
    assert got["loss"] == pytest.approx(float(nll), rel=1e-6)
    assert got["top1"] == pytest.approx(float((logp.argmax(-1) == tokens[1:]).float().mean()))
    assert got["top10"] == pytest.approx(float((logp.topk(10).indices == tokens[1:, None]).any(-1).float().mean()))


def test_reciprocal_ranks_by_hand() -> None:
    """rank = 1 + entries with a strictly larger logit; ties count in the target's favour."""
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.0, -1.0],  # target 1: one larger logit -> rank 2
            [0.5, 0.5, 0.5, 0.5],  # target 3: all tied -> rank 1
            [5.0, 3.0, 3.0, 0.0],  # target 2: tied with 1, below 0 -> rank 2
        ]
    )
    targets = torch.tensor([1, 3, 2])
    got = E.reciprocal_ranks(logits, targets)
    torch.testing.assert_close(got, torch.tensor([1 / 2, 1.0, 1 / 2]))
    assert float(got.mean()) == pytest.approx((1 / 2 + 1 + 1 / 2) / 3)
    top = E.reciprocal_ranks(torch.tensor([[-1.0, 7.0, 7.0, 2.0]]), torch.tensor([2]))  # tied for the top
    assert float(top) == 1.0


def test_predictive_entropy_by_hand() -> None:
    row = [2.0, 1.0, 0.0, -1.0]
    log_z = math.log(sum(math.exp(v) for v in row))
    h_row = -sum(math.exp(v - log_z) * (v - log_z) for v in row)
    logits = torch.tensor(
        [
            row,
            [0.5, 0.5, 0.5, 0.5],  # uniform: log 4
            [0.0, 0.0, -math.inf, -math.inf],  # two equal, two impossible: log 2
            [1e30, 0.0, 0.0, 0.0],  # one certain, the rest exp(-1e30) = 0: 0
            [1000.0, 1000.0, -1000.0, 0.0],  # the last two underflow to probability 0: log 2
        ]
    )
    got = E.predictive_entropy(logits)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, torch.tensor([h_row, math.log(4), math.log(2), 0.0, math.log(2)]))
    torch.testing.assert_close(E.predictive_entropy(logits, torch.log_softmax(logits, -1)), got)


def test_position_buckets_by_hand() -> None:
    sums, counts = [1.0, 2.0, 3.0, 4.0, 10.0], [1, 1, 1, 1, 2]
    two = E.position_buckets(sums, counts, 2)  # edges 0, 2, 5
    assert [(b.start, b.end, b.count) for b in two] == [(0, 2, 2), (2, 5, 4)]
    assert two[0].mean_loss == pytest.approx(3 / 2) and two[1].mean_loss == pytest.approx(17 / 4)
    each = E.position_buckets(sums, counts)  # L = 5 <= 16 buckets: one per position
    assert [(b.start, b.end) for b in each] == [(i, i + 1) for i in range(5)]
    assert each[4].mean_loss == pytest.approx(5.0)
    assert [(b.start, b.end) for b in E.position_buckets([1.0, 0.0, 2.0], [1, 0, 1], 3)] == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="same length"):
        E.position_buckets([1.0], [1, 2])


def test_sliding_window_bad_input() -> None:
    tokens = torch.arange(30) % 7
    with pytest.raises(TypeError, match="logits_fn"):
        E.sliding_window_metrics("model", tokens, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stride"):
        E.sliding_window_metrics(lambda x: torch.zeros(*x.shape, 7), tokens, 8, 9)
    with pytest.raises(ValueError, match="num_tokens"):
        E.sliding_window_metrics(lambda x: torch.zeros(*x.shape, 7), tokens, 30)
    with pytest.raises(ValueError, match="logits_fn returned"):
        E.sliding_window_metrics(lambda x: torch.zeros(1, 7), tokens, 8)


# --------------------------------------------------------------------------------------------------
# Cost accounting
# --------------------------------------------------------------------------------------------------


def test_window_cost_counts_causal_entries() -> None:
    for n in (1, 5, 17):
        for w in (0, 1, 3, 16, 40):
            brute = sum(1 for i in range(n) for j in range(n) if j <= i and i - j <= w)
            assert E.window_cost(w, n) == brute


def test_expected_plsh_cost_counts_same_block_pairs() -> None:
    slopes = torch.tensor([0.5, 0.1, 0.0])
    got = E.expected_plsh_cost(slopes, 30, draws=64, seed=3)
    labels = sample_partitions(30, slopes, 64, generator=3).labels()  # (T, H, n)
    same = (labels[..., :, None] == labels[..., None, :]).tril()  # causal pairs in one block
    torch.testing.assert_close(got, same.sum((-1, -2)).double().mean(0))
    assert float(got[2]) == 30 * 31 / 2  # slope 0: one block


def test_expected_plsh_cost_matches_theory_far_from_the_ends() -> None:
    m = alibi_slopes(4).double()
    got = E.expected_plsh_cost(m, 40000, draws=2000) / 40000
    # discrete scheme: a token's block has (B + 1) / 2 causal keys on average over positions, E = 1 / (1 - e^-m)
    theory = 1 / (1 - torch.exp(-m))
    torch.testing.assert_close(got, theory, rtol=0.03, atol=0)


def test_equal_cost_window_is_the_largest_window_within_budget() -> None:
    slopes = alibi_slopes(8)
    n, t = 256, 4
    target = E.expected_plsh_cost(slopes, n) * t
    windows = E.equal_cost_window(slopes, t, n)
    for w, c in zip(windows.tolist(), target.tolist(), strict=True):
        assert E.window_cost(int(w), n) <= c or w == 0
        assert w == n - 1 or E.window_cost(int(w) + 1, n) > c
    assert windows[0] < windows[-1]  # steep heads get short windows


# --------------------------------------------------------------------------------------------------
# plsh eval on checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A data directory, its tokenizer and a small trained-looking ALiBi checkpoint (random weights)."""
    root = tmp_path_factory.mktemp("eval")
    docs = D.load_corpus()
    data = root / "data"
    for split, chosen in (("train", docs[:2]), ("validation", docs[10:11]), ("test", docs[11:13])):
        (data / split).mkdir(parents=True)
        for i, d in enumerate(chosen):
            (data / split / f"{i}.txt").write_text(d.text[:3000], encoding="utf-8")
    tok = D.train_tokenizer(D.load_splits(str(data))["train"], 300)
    tok_file = tok.save(root / "tok")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, seq_len=16, n_layer=1, n_head=4, d_model=32, position="alibi")
    ckpt = save_checkpoint(root / "alibi-ck", TransformerLM(cfg), tok, metadata={"train_config": {"data": str(data)}})
    return data, tok_file, ckpt


def test_evaluate_checkpoint_rows_and_determinism(eval_setup: tuple[Path, Path, Path]) -> None:
    _, _, ckpt = eval_setup
    kw = dict(
        data=None, split="test", train_len=None, tokenizer=None, cache_dir=None, seed=0, device=torch.device("cpu")
    )
    adapter, stream = E.load_for_eval(ckpt, label="toy", **kw)
    assert adapter.train_len == 16 and stream.numel() > 400
    run = dict(factors=(1, 2), max_tokens=200, samples=(1, 4), schemes=("discrete", "fixed"), progress=False)
    rows = E.evaluate_model(adapter, stream, **run)
    kinds = [(r.kind, r.eval_len) for r in rows]
    assert kinds[:2] == [("own", 16), ("own", 32)]
    assert sum(k == "plsh" for k, _ in kinds) == 2 * 2 * 2 and sum(k == "window" for k, _ in kinds) == 2 * 2
    assert all(r.tokens == 200 and r.stride == 16 for r in rows)
    own = {r.eval_len: r for r in rows if r.kind == "own"}
    assert own[16].cost_per_query == pytest.approx(8.5)  # exact causal attention at n=16: (n+1)/2
    for r in rows:
        if r.kind == "window" and r.samples == 4 and r.eval_len == 16:
            assert r.ppl == pytest.approx(own[16].ppl, rel=1e-6)  # 4 samples cost as much as exact: full window
        if r.kind == "plsh" and r.scheme == "fixed":
            assert r.cost_per_query is not None
    again = E.evaluate_model(adapter, stream, **run)
    assert [r.loss for r in rows] == [r.loss for r in again]  # seeded eval partitions
    assert adapter.model.cfg.position == "alibi"  # the model's own attention is restored


def test_cli_writes_table_csv_and_plots(eval_setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, _, ckpt = eval_setup
    out = tmp_path / "res"
    argv = [str(ckpt), str(ckpt), "--labels", "a,b", "--factors", "1,2", "--max-tokens", "120", "--samples", "2",
            "--schemes", "gamma", "--sweep-factors", "1", "--out", str(out), "--no-progress",
            "--cache-dir", ""]  # fmt: skip
    assert cli_eval.main(argv) == 0
    for name in (
        "results.csv",
        "results.md",
        "extrapolation.png",
        "sweep.png",
        "loss_by_position.csv",
        "loss_by_position.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * (2 + 2)  # per model: own x2 lengths, plsh + window at 1x
    assert {r["model"] for r in rows} == {"a", "b"}
    back = E.read_results(out / "results.csv")
    assert back[0].eval_len == 16 and isinstance(back[0].ppl, float) and back[0].samples is None
    assert rows[0]["loss"] == rows[4]["loss"]  # same checkpoint twice, same numbers


def test_new_metrics_end_to_end(eval_setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """MRR, entropy and loss by position on a tiny checkpoint, through plsh eval's files."""
    _, _, ckpt = eval_setup
    out = tmp_path / "res"
    argv = [str(ckpt), "--factors", "1,2", "--stride", "5", "--max-tokens", "150", "--samples", "none",
            "--out", str(out), "--no-progress", "--cache-dir", ""]  # fmt: skip
    assert cli_eval.main(argv) == 0
    rows = E.read_results(out / "results.csv")
    vocab = D.BPETokenizer.load(ckpt / "tokenizer.json").vocab_size
    assert [r.eval_len for r in rows] == [16, 32]
    for r in rows:
        assert r.mrr is not None and 0 < r.mrr <= 1 and r.mrr >= r.top1
        assert r.entropy is not None and 0 <= r.entropy <= math.log(vocab)
        buckets = r.loss_by_position  # read back from loss_by_position.csv
        assert len(buckets) == 16 and buckets[0].start == 0 and buckets[-1].end == r.eval_len
        assert sum(b.count for b in buckets) == r.tokens == 150
        assert sum(b.mean_loss * b.count for b in buckets) / r.tokens == pytest.approx(r.loss, abs=1e-6)
    assert [(b.start, b.end) for b in rows[1].loss_by_position][:2] == [(0, 2), (2, 4)]  # L = 32: width 2
    with open(out / "loss_by_position.csv") as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == ["model", "attention", "kind", "factor", "eval_len", "pos_start", "pos_end",
                              "mean_loss", "count"]  # fmt: skip
    assert len(lines) == 2 * 16 and sum(int(x["count"]) for x in lines) == 2 * 150
    with open(out / "results.csv") as f:
        assert {"mrr", "entropy"} <= set(next(csv.DictReader(f)))
    assert "| MRR | entropy |" in (out / "results.md").read_text()
    assert (out / "loss_by_position.png").stat().st_size > 0


def test_plsh_trained_checkpoint_gets_exact_alibi_rows(eval_setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    data, _, ckpt = eval_setup
    from positional_lsh.lm import load_checkpoint

    ck = load_checkpoint(ckpt)
    ck.model.set_position("plsh", num_samples=2)
    save_checkpoint(tmp_path / "p", ck.model, ck.tokenizer, metadata={"train_config": {"data": str(data)}})
    kw = dict(
        data=None, split="test", train_len=None, tokenizer=None, cache_dir=None, seed=0, device=torch.device("cpu")
    )
    adapter, stream = E.load_for_eval(tmp_path / "p", label="p", **kw)
    rows = E.evaluate_model(adapter, stream, factors=(1,), max_tokens=100, samples=(), progress=False)
    assert [(r.kind, r.attention) for r in rows] == [("own", "own: plsh T=2 discrete"), ("alibi", "exact ALiBi")]


def test_eval_bad_input(eval_setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_eval.main([str(tmp_path), "--no-progress"]) == 2
    assert "neither" in capsys.readouterr().err
    _, _, ckpt = eval_setup
    assert cli_eval.main([str(ckpt), "--split", "nope", "--no-progress", "--cache-dir", ""]) == 2
    assert cli_eval.main([str(ckpt), "--labels", "a,b", "--no-progress"]) == 2
    with pytest.raises(SystemExit):
        cli_eval.main([str(ckpt), "--schemes", "uniform"])
    with pytest.raises(SystemExit):
        cli_eval.main([str(ckpt), "--factors", "0"])


def test_transformers_checkpoint_path(eval_setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """A local BLOOM folder: its own attention, and the library's exact ALiBi through the hf swap, agree."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("positional_lsh.integrations.hf")
    data, tok_file, _ = eval_setup
    vocab = D.BPETokenizer.load(tok_file).vocab_size
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=vocab, n_layer=1, n_head=4, hidden_size=32)
    transformers.BloomForCausalLM(cfg).save_pretrained(tmp_path / "bloom")
    kw = dict(data=str(data), split="test", train_len=None, tokenizer=str(tok_file), cache_dir=None, seed=0)
    with pytest.raises(ValueError, match="train-len"):
        E.load_for_eval(tmp_path / "bloom", label="bloom", device=torch.device("cpu"), **kw)
    kw["train_len"] = 16
    adapter, stream = E.load_for_eval(tmp_path / "bloom", label="bloom", device=torch.device("cpu"), **kw)
    rows = E.evaluate_model(adapter, stream, factors=(1, 2), max_tokens=100, samples=(4,), schemes=("discrete",),
                            progress=False)  # fmt: skip
    by = {(r.kind, r.eval_len): r for r in rows}
    assert by[("own", 16)].attention == "own: native bloom"
    for n in (16, 32):
        assert by[("alibi", n)].loss == pytest.approx(by[("own", n)].loss, rel=1e-5)
    assert ("plsh", 16) in by and ("window", 32) in by


@pytest.mark.skipif(not (E.shipped_checkpoint_path() / "model.safetensors").is_file(), reason="no shipped model")
def test_shipped_model_demo_is_fast_and_sensible() -> None:
    demo = E.shipped_model_demo(progress=False, samples=(1, 16), num_tokens=1024, new_tokens=12)
    exact, t1, t16 = (r["ppl"] for r in demo.rows)
    assert 1 < exact < 1000
    assert abs(t16 - exact) < abs(t1 - exact) + 0.05 * exact
    assert demo.continuation and "Persuasion" in demo.description
    assert demo.seconds < 30
    assert "exact ALiBi" in str(demo)


def test_cross_entropy_convention() -> None:
    """Loss is in nats per token: a uniform model over V tokens has perplexity V."""
    tokens = torch.randint(0, 9, (50,), generator=torch.Generator().manual_seed(0))
    got = E.sliding_window_metrics(lambda x: torch.zeros(*x.shape, 9), tokens, 10)
    assert got["ppl"] == pytest.approx(9.0) and got["bits_per_token"] == pytest.approx(math.log2(9))
    assert F.cross_entropy(torch.zeros(1, 9), torch.tensor([0])).item() == pytest.approx(math.log(9))


def _long_context_module(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "long_context.py"
    spec = importlib.util.spec_from_file_location("long_context", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "long_context", module)
    spec.loader.exec_module(module)
    return module


def test_long_context_cost_accounting_against_dense_masks(monkeypatch):
    # benchmarks/long_context.py chooses the equal-cost window from these counts: check them against masks built
    # from the definitions (the union of a query's T blocks, causal; a window of w keeps |i - j| <= w).
    lc = _long_context_module(monkeypatch)
    n, heads, t = 96, 4, 5
    from positional_lsh.lm.config import ModelConfig

    slopes = ModelConfig(n_head=heads, seq_len=n).slopes()
    union = 0.0
    for seed in range(4):
        parts = sample_partitions(n, slopes, t, generator=torch.Generator().manual_seed(seed))
        lab = parts.labels()  # (T, H, n)
        same = (lab[..., :, None] == lab[..., None, :]).any(0)  # (H, n, n): i and j share a block in some sample
        union += float((same & torch.ones(n, n, dtype=torch.bool).tril()).sum()) / 4
    assert lc.union_entries(n, heads, t) == pytest.approx(union / (heads * n), rel=1e-12)
    f = 3.0
    w = torch.floor(f / slopes)
    dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    keep = [((dist >= 0) & (dist <= wh)).sum() for wh in w.tolist()]
    assert lc.window_entries(n, heads, f) == pytest.approx(float(sum(keep)) / (heads * n), rel=1e-12)
    g = lc.equal_cost_window_factor(n, heads, t)
    assert lc.window_entries(n, heads, g) == pytest.approx(lc.union_entries(n, heads, t), rel=0.05)


def test_position_saved_reads_a_swap_recorded_only_in_config_json(eval_setup: tuple[Path, Path, Path],
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """Issue 34 item 10: a folder whose swap is in config.json only (no positional_lsh_swap.json) is scored with it."""
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("positional_lsh.integrations.hf")
    data, tok_file, _ = eval_setup
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=D.BPETokenizer.load(tok_file).vocab_size, n_layer=1, n_head=4,
                                   hidden_size=32)  # fmt: skip
    model = transformers.BloomForCausalLM(cfg)
    hf.use_alibi(model, window=3.0)
    model.save_pretrained(tmp_path / "bloom")
    (tmp_path / "bloom" / hf.SWAP_FILE).unlink()
    kw = dict(data=str(data), split="test", train_len=16, tokenizer=str(tok_file), cache_dir=None, seed=0)
    adapter, _ = E.load_for_eval(tmp_path / "bloom", label="bloom", device=torch.device("cpu"), **kw)
    swap = hf.current_swap(adapter.model)
    assert swap is not None and swap.window is not None and float(swap.window[0]) == 3.0
    assert adapter.own.startswith("window-alibi window 3")
