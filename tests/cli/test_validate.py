"""Q/K/V capture from real architectures and the ``plsh validate`` experiment on small inputs."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
import torch
from torch import nn

from positional_lsh import alibi_attention, alibi_slopes
from positional_lsh.cli.validate import (
    MEASUREMENT_FIELDS,
    ValidateConfig,
    command_line,
    config_from_args,
    register_cli,
    run_validation,
)
from positional_lsh.theory.capture import capture_qkv, model_alibi_slopes, synthetic_qkv, tokenize_contexts
from positional_lsh.theory.qkv import CapturePoint, split_fused_blocks

from conftest import read_csv

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(model_type: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **kw)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _context_hook(store: list[torch.Tensor]):
    def hook(_mod, inp):
        store.append(inp[0].detach())

    return hook


ALIBI_MODELS = {
    "bloom": (dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=97), ("h", "self_attention", "dense")),
    "mpt": (dict(d_model=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=64), ("blocks", "attn", "out_proj")),
    "falcon": (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=97,
            alibi=True,
            bias=True,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
        ),
        ("h", "self_attention", "dense"),
    ),
    "falcon-multiquery": (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=97,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=True,
        ),
        ("h", "self_attention", "dense"),
    ),
    "falcon-grouped": (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            vocab_size=97,
            alibi=True,
            new_decoder_architecture=True,
        ),
        ("h", "self_attention", "dense"),
    ),
}


@pytest.mark.parametrize("name", list(ALIBI_MODELS))
def test_captured_qkv_and_slopes_reproduce_the_models_alibi_attention(name):
    kw, (blocks_attr, attn_attr, out_attr) = ALIBI_MODELS[name]
    model = _tiny(name.split("-")[0], **kw)
    if name.startswith("falcon"):
        model.config._attn_implementation = "sdpa"  # the eager path adds the ALiBi bias twice (see docs/hf.md)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    store: list[torch.Tensor] = []
    attn = getattr(getattr(model.transformer, blocks_attr)[1], attn_attr)
    handle = getattr(attn, out_attr).register_forward_pre_hook(_context_hook(store))
    try:
        layers = capture_qkv(model, ids, layers=[-1], stop_early=False)
    finally:
        handle.remove()
    assert [x.layer for x in layers] == [1]
    lq = layers[0]
    slopes = model_alibi_slopes(model)
    assert slopes is not None and slopes.shape == (4,)
    ref = alibi_attention(lq.q.double(), lq.k.double(), lq.v.double(), slopes, causal=True)
    b, h, n, d = ref.shape
    torch.testing.assert_close(ref.transpose(1, 2).reshape(b, n, h * d), store[0].double(), rtol=1e-5, atol=1e-5)


def test_model_alibi_slopes_conventions():
    # BLOOM's own builder (the stock model's slopes) computes the schedule in float32 powers: 1 ulp off for 2 heads.
    bloom = model_alibi_slopes(_tiny("bloom", hidden_size=48, n_layer=1, n_head=12))
    torch.testing.assert_close(bloom, alibi_slopes(12).double(), rtol=1.2e-7, atol=0)
    mpt = _tiny("mpt", d_model=48, n_layers=1, n_heads=12, max_seq_len=16)
    torch.testing.assert_close(model_alibi_slopes(mpt), alibi_slopes(12).double())
    llama = _tiny("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    assert model_alibi_slopes(llama) is None


@pytest.mark.parametrize(
    "model_type, kw, blocks, out_attr",
    [
        ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=97), "h", ("attn", "c_proj")),
        (
            "gpt_neox",
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=97,
                rotary_pct=0.0,
                partial_rotary_factor=0.0,
            ),
            "layers",
            ("attention", "dense"),
        ),
    ],
)
def test_captured_qkv_reproduce_plain_attention(model_type, kw, blocks, out_attr):
    model = _tiny(model_type, **kw)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 97, (1, 19), generator=torch.Generator().manual_seed(1))
    store: list[torch.Tensor] = []
    body = model.transformer if hasattr(model, "transformer") else model.gpt_neox
    mod = getattr(getattr(getattr(body, blocks)[0], out_attr[0]), out_attr[1])
    handle = mod.register_forward_pre_hook(_context_hook(store))
    try:
        lq = capture_qkv(model, ids, layers=[0], stop_early=False)[0]
    finally:
        handle.remove()
    ref = alibi_attention(lq.q.double(), lq.k.double(), lq.v.double(), 0.0, causal=True)
    b, h, n, d = ref.shape
    torch.testing.assert_close(ref.transpose(1, 2).reshape(b, n, h * d), store[0].double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral"])
def test_llama_family_capture_is_pre_rope_projection_output(model_type):
    model = _tiny(
        model_type,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=97,
    )
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(2))
    inputs: list[torch.Tensor] = []
    attn = model.model.layers[1].self_attn
    handle = attn.q_proj.register_forward_pre_hook(_context_hook(inputs))
    calls = []
    last = model.model.layers[2].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        lq = capture_qkv(model, ids, layers=[1])[0]
    finally:
        handle.remove()
        last.remove()
    assert calls == []  # stopped after layer 1
    assert lq.q.shape == (2, 4, 13, 16) and lq.k.shape == (2, 2, 13, 16) and lq.v.shape == (2, 2, 13, 16)
    x = inputs[0]
    torch.testing.assert_close(lq.q, attn.q_proj(x).reshape(2, 13, 4, 16).transpose(1, 2))
    torch.testing.assert_close(lq.k, attn.k_proj(x).reshape(2, 13, 2, 16).transpose(1, 2))
    _, kh, vh = lq.head(3)
    assert torch.equal(kh, lq.k[0, 1]) and torch.equal(vh, lq.v[0, 1])


class _NanoBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)
        return x + 0.1 * torch.tanh(q + k + v)


class _NanoModel(nn.Module):
    """A stand-in for the project's own decoder: opts in by naming its projections."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.blocks = nn.ModuleList([_NanoBlock(24, 3) for _ in range(2)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return x

    def qkv_capture_points(self) -> list[CapturePoint]:
        return [CapturePoint(i, b.c_attn, "qkv", split_fused_blocks(3, 3, 8)) for i, b in enumerate(self.blocks)]


def test_protocol_opt_in_for_a_custom_model():
    torch.manual_seed(0)
    model = _NanoModel()
    ids = torch.randint(0, 50, (1, 10))
    layers = capture_qkv(model, ids)
    assert [x.layer for x in layers] == [0, 1]
    x = model.emb(ids)
    q, _, v = model.blocks[0].c_attn(x).split(24, dim=-1)
    torch.testing.assert_close(layers[0].q, q.reshape(1, 10, 3, 8).transpose(1, 2))
    torch.testing.assert_close(layers[0].v, v.reshape(1, 10, 3, 8).transpose(1, 2))
    with pytest.raises(ValueError, match="layer 5"):
        capture_qkv(model, ids, layers=[5])
    with pytest.raises(ValueError, match="qkv_capture_points"):
        capture_qkv(nn.Sequential(nn.Embedding(5, 4)), ids % 5)
    with pytest.raises(ValueError, match="role"):
        CapturePoint(0, model.blocks[0], "x", lambda t: t)


def test_tokenize_contexts_and_synthetic():
    text = " ".join(str(i) for i in range(1000))
    ids = tokenize_contexts(lambda s: [int(w) for w in s.split()], text, 7, 3)
    assert ids.tolist() == [list(range(0, 7)), list(range(7, 14)), list(range(14, 21))]
    with pytest.raises(ValueError, match="tokens"):
        tokenize_contexts(lambda s: s.split(), "a b c", 4, 1)
    layers = synthetic_qkv(2, 4, 16, 8, num_kv_heads=2, generator=3)
    assert layers[1].q.shape == (1, 4, 16, 8) and layers[1].k.shape == (1, 2, 16, 8)
    assert torch.equal(synthetic_qkv(2, 4, 16, 8, num_kv_heads=2, generator=3)[1].v, layers[1].v)


# ------------------------------------------------------------------------------------------ plsh validate


def _small(out, **kw) -> ValidateConfig:
    base = dict(
        out_dir=str(out),
        source="synthetic",
        seq_lens=(128,),
        samples=(1, 10, 100, 1000),
        synthetic_layers=1,
        synthetic_heads=4,
        repeats=2,
        compare_repeats=2,
        compare_schemes=("discrete", "discrete-strat"),
        lengths=(128, 4096),
        length_samples=20,
        unbiasedness_replicates=400,
        report_adversarial_lengths=(64,),
        report_adversarial_samples=(4,),
        slope_grad_samples=(),  # the slope-gradient section: tests/cli/test_validate_slope_grad.py
        progress=False,
    )
    base.update(kw)
    return ValidateConfig(**base)


def test_validate_synthetic_run_and_findings(tmp_path):
    res = run_validation(_small(tmp_path))
    for name in ("measurements", "schemes", "lengths", "unbiasedness", "config", "report"):
        assert res.files[name].is_file()
    for png in ("error_vs_samples", "error_vs_length", "schemes"):
        assert res.files[png].stat().st_size > 5000
    rows = read_csv(res.files["measurements"])
    assert list(rows[0]) == list(MEASUREMENT_FIELDS)
    assert len(rows) == 1 * 2 * 4 * 2 * 4  # layers x schemes x samples x repeats x heads
    assert all(int(r["seed"]) > 0 for r in rows)
    f = res.findings
    # the findings the issue requires, on synthetic inputs
    indep = next(x for x in f["fits"] if x["scheme"] == "discrete")
    assert -0.6 <= indep["slope"] <= -0.4 and f["slope_check"] is True
    strat = next(x for x in f["fits"] if x["scheme"] == "discrete-strat")
    assert strat["slope"] < indep["slope"]  # stratification beats the Monte Carlo rate
    assert f["bound_check"] is True and f["under_expected_bound"] == 1.0 and f["bound_over_error_min"] > 1
    assert f["unbiased"] == {"discrete": True, "discrete-strat": True, "fixed": False}
    assert f["unbiased_check"] is True
    assert f["variance_reduction_summary"]["discrete-strat"]["relative_spectral"]["geomean"] > 1.5
    report = res.files["report"].read_text()
    for text in (
        "## Findings",
        "Fitted slope",
        "expectation bound",
        "Unbiasedness",
        "## Metrics vs samples",
        "E-bound (rel)",
        "suggested s",
        "## Error vs length",
        "## Variance reduction",
        "error_vs_samples.png",
    ):
        assert text in report, text
    meta = json.loads(res.files["config"].read_text())
    assert meta["config"]["seed"] == 0 and meta["command"].startswith("plsh validate --out")
    lengths = read_csv(res.files["lengths"])
    assert {int(r["seq_len"]) for r in lengths} == {128, 4096}


def test_validate_block_and_adversarial_sections(tmp_path):
    """The report's block-size and adversarial sections, checked against independent computations."""
    import math
    import re

    from positional_lsh import sample_partitions
    from positional_lsh.ops.exact.reference import alibi_matrix
    from positional_lsh.theory.adversarial import uniform_error_bound

    n, heads = 96, 4
    cfg = _small(tmp_path, seq_lens=(n,), samples=(1, 10, 100), compare_samples=0, lengths=(),
                 unbiasedness_replicates=0, plots=False, report_adversarial_samples=(4, 16))  # fmt: skip
    res = run_validation(cfg)
    slopes = alibi_slopes(heads).double()
    report = res.files["report"].read_text()
    assert "## Block sizes" in report and "## Adversarial inputs vs the uniform bound" in report
    blocks = res.blocks
    assert len(blocks) == 2 * 3 * 2 * heads and read_csv(res.files["blocks"])[0]["largest"] == str(blocks[0]["largest"])
    for r in blocks:
        parts = sample_partitions(n, slopes, r["samples"], scheme=r["scheme"], generator=r["seed"])
        lab = parts.labels()[:, r["head"]]  # (s, n)
        sizes = [torch.unique_consecutive(row, return_counts=True)[1] for row in lab]
        assert r["largest"] == max(int(c.max()) for c in sizes)
        assert r["work"] == sum(float((c.double() ** 2).sum()) for c in sizes)
        # the bound: smallest L with 1 - (1 - P[B > L])^s <= delta, P[B > L] = x^L (1 + L (1 - x)), by a scan
        x = math.exp(-r["slope"])
        tail = [x**L * (1 + L * (1 - x)) for L in range(n)]
        want = next((L for L in range(n) if 1 - (1 - tail[L]) ** r["samples"] <= 0.01), n)
        assert r["bound"] == want
        assert r["within_bound"] == (r["largest"] <= want)
    f = res.findings
    assert f["blocks_within_bound"] == sum(r["largest"] <= r["bound"] for r in blocks) / len(blocks)
    assert f["largest_block"] == max(r["largest"] for r in blocks)
    one = next(r for r in blocks if r["scheme"] == "discrete" and r["samples"] == 10 and r["head"] == 1)
    largest = max(r["largest"] for r in blocks if (r["scheme"], r["samples"], r["head"]) == ("discrete", 10, 1))
    section = report.split("scheme=discrete: largest block / bound")[1].split("###")[0]
    assert re.search(rf"\| 1 \| 16 \| [^|]+ \| {largest} / {int(one['bound'])} \|", section)  # the s=10 column
    # adversarial: one row per distinct slope and T; the bounds recomputed, no input above them
    adv = res.adversarial
    assert len(adv) == heads * 2 and f["adversarial_violations"] == 0
    c = 1.0
    for r in adv:
        parts = sample_partitions(64, [r["slope"]], r["T"], generator=r["seed"])
        assert r["bound_tight"] == pytest.approx(uniform_error_bound(parts, 0, c).tight, rel=1e-12)
        mbar, a = parts.mean_mask()[0], alibi_matrix(64, torch.tensor([r["slope"]]))[0]
        keep = torch.tril(torch.ones(64, 64, dtype=torch.bool))
        simple = 2 * math.exp(2 * c) * float(((mbar - a).abs() * keep).sum(1).div((a * keep).sum(1)).max())
        assert r["bound_simple"] == pytest.approx(simple, rel=1e-10)
        assert r["gaussian"] <= r["worst"] <= r["bound_tight"] * (1 + 1e-9) <= r["bound_simple"]
        assert f"| {r['heads']} | " in report.split("## Adversarial inputs")[1]
    assert "No input above the bound." in report


def test_validate_is_reproducible(tmp_path):
    cfg = dict(samples=(1, 10), compare_samples=0, lengths=(), unbiasedness_replicates=0, plots=False, repeats=1)
    a = run_validation(_small(tmp_path / "a", **cfg))
    b = run_validation(_small(tmp_path / "b", **cfg))
    ra, rb = read_csv(a.files["measurements"]), read_csv(b.files["measurements"])
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in ra] == [
        {k: v for k, v in r.items() if k != "seconds"} for r in rb
    ]
    c = run_validation(_small(tmp_path / "c", seed=1, **cfg))
    assert read_csv(c.files["measurements"])[0]["spectral"] != ra[0]["spectral"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plsh")
    register_cli(parser.add_subparsers(dest="command"))
    return parser


def test_cli_roundtrip_and_run(tmp_path, capsys):
    cfg = _small(
        tmp_path / "cli",
        samples=(1, 10),
        slopes=("standard", "sigma=32"),
        compare_samples=0,
        lengths=(),
        unbiasedness_replicates=0,
        plots=False,
        causal=False,
    )
    line = command_line(cfg)
    args = _parser().parse_args([*shlex.split(line)[1:], "--quiet"])
    assert config_from_args(args) == cfg
    assert args.func(args) == 0
    assert "report:" in capsys.readouterr().out
    rows = read_csv(tmp_path / "cli" / "measurements.csv")
    assert {r["slope_set"] for r in rows} == {"standard", "sigma=32"}
    assert {float(r["slope"]) for r in rows if r["slope_set"] == "sigma=32"} == {1 / 32}
    from positional_lsh.cli import main  # every command's errors go through positional_lsh.cli.guarded

    assert main(["validate", "--out", str(tmp_path / "y"), "--schemes", "nope"]) == 2
    assert "unknown scheme 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(schemes=("nope",)), "scheme"),
        (dict(slopes=("sigma=-1",)), "sigma"),
        (dict(slopes=("steep",)), "slope set"),
        (dict(source="checkpoint"), "checkpoint"),
        (dict(source="checkpoint", checkpoint="/x"), "text"),
        (dict(samples=(0,)), "samples"),
        (dict(eps=2.0), "eps"),
    ],
)
def test_validate_config_errors(tmp_path, kw, word):
    with pytest.raises(ValueError, match=word):
        _small(tmp_path, **kw)


def test_validate_on_a_local_checkpoint(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = " ".join(f"word{i % 37} token{i % 11}" for i in range(3000))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    model = _tiny("bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=tok.get_vocab_size())
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(ckpt)
    (tmp_path / "text.txt").write_text(text)
    cfg = _small(
        tmp_path / "out",
        source="checkpoint",
        checkpoint=str(ckpt),
        text=str(tmp_path / "text.txt"),
        seq_lens=(96,),
        num_inputs=2,
        layers=(-1,),
        slopes=("model",),
        samples=(1, 10),
        repeats=1,
        compare_samples=0,
        lengths=(),
        unbiasedness_replicates=0,
        plots=False,
    )
    res = run_validation(cfg)
    rows = res.measurements
    assert {r["layer"] for r in rows} == {1} and {r["input"] for r in rows} == {0, 1}
    slopes = sorted({r["slope"] for r in rows})
    assert slopes == pytest.approx(sorted(alibi_slopes(4).double().tolist()))
    assert all(0 <= r["softmax_rel"] < 2 and 0 < r["cosine_mean"] <= 1 + 1e-12 for r in rows)
    assert "checkpoint" in res.files["report"].read_text()


def _shipped():
    try:
        from positional_lsh.lm import load_shipped_model

        return load_shipped_model()
    except (ImportError, FileNotFoundError):
        pytest.skip("the shipped model is not available")


def test_shipped_model_capture_reproduces_its_attention():
    ckpt = _shipped()
    model = ckpt.model
    ids = torch.tensor([ckpt.tokenizer.encode("It is a truth universally acknowledged, that a single man. " * 4)])
    store: list[torch.Tensor] = []
    handle = model.blocks[-1].attn.proj.register_forward_pre_hook(_context_hook(store))
    try:
        layers = capture_qkv(model, ids, stop_early=False)
    finally:
        handle.remove()
    assert [x.layer for x in layers] == list(range(len(model.blocks)))
    slopes = model_alibi_slopes(model)
    assert slopes is not None
    lq = layers[-1]
    ref = alibi_attention(lq.q.double(), lq.k.double(), lq.v.double(), slopes, causal=True)
    b, h, n, d = ref.shape
    torch.testing.assert_close(ref.transpose(1, 2).reshape(b, n, h * d), store[0].double(), rtol=1e-5, atol=1e-5)


def test_validate_shipped_source(tmp_path):
    _shipped()
    cfg = _small(
        tmp_path,
        source="shipped",
        seq_lens=(64,),
        layers=(-1,),
        heads=(0, 7),
        samples=(1, 10),
        repeats=1,
        slopes=("model",),
        compare_samples=0,
        lengths=(),
        unbiasedness_replicates=0,
        plots=False,
    )
    res = run_validation(cfg)
    assert {r["head"] for r in res.measurements} == {0, 7}
    assert sorted({r["slope"] for r in res.measurements}) == pytest.approx([2.0**-8, 0.5])
    assert "shipped" in res.files["report"].read_text()
