"""``plsh validate``'s slope-gradient section (cli/validate/slope_grad.py): wiring, files, report, bad flags."""

from __future__ import annotations

import json
import math
import shlex

import pytest
import torch

from positional_lsh import alibi_slopes
from positional_lsh.cli import main
from positional_lsh.cli.validate import ValidateConfig, command_line, run_validation
from positional_lsh.cli.validate.inputs import Context
from positional_lsh.cli.validate.settings import derive_seed
from positional_lsh.cli.validate.slope_grad import SLOPE_GRAD_FIELDS, slope_grad_inputs
from positional_lsh.theory.capture import LayerQKV, synthetic_qkv
from positional_lsh.theory.slope_grad import exact_slope_gradient, loss_weight, shipped_qkv, slope_gradient_study

from conftest import read_csv

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(out, **kw) -> ValidateConfig:
    """A run whose other experiments are as small as they go: the section is what is measured."""
    base = dict(
        out_dir=str(out), source="synthetic", seq_lens=(32,), samples=(1, 4), synthetic_layers=1, synthetic_heads=2,
        synthetic_head_dim=8, compare_samples=0, lengths=(), unbiasedness_replicates=0,
        report_adversarial_lengths=(), slope_grad_samples=(1, 4), slope_grad_len=16, slope_grad_replicates=4,
        progress=False,
    )  # fmt: skip
    base.update(kw)
    return ValidateConfig(**base)


def test_section_in_the_full_run_reproduces_the_study(tmp_path):
    cfg = _tiny(tmp_path)
    res = run_validation(cfg)
    rows = read_csv(res.files["slope_grad"])
    assert list(rows[0]) == SLOPE_GRAD_FIELDS
    assert {r["inputs"] for r in rows} == {"gaussian"}  # a synthetic source has no model input
    assert res.files["slope_grad"].name == "slope_grad.csv" and res.files["slope_grad"].stat().st_size > 0
    assert res.files["slope_grad"].parent == tmp_path and (tmp_path / "slope_grad.png").stat().st_size > 5000
    # the same numbers from the theory room's study on the same inputs and seed
    seed = derive_seed(0, "slope-grad", "gaussian")
    x = synthetic_qkv(1, 2, 16, 8, generator=seed)[0]
    st = slope_gradient_study(x.q, x.k, x.v, alibi_slopes(2).double(), samples=(1, 4), replicates=4, seed=seed,
                              label="gaussian")  # fmt: skip
    assert len(rows) == len(st.rows) == 3 * 2 * 3  # estimators x T x (norm + 2 heads)
    for got, want in zip(rows, st.rows, strict=True):
        assert (got["estimator"], int(got["T"]), int(got["head"])) == (want.estimator, want.T, want.head)
        assert float(got["rel_bias"]) == pytest.approx(want.rel_bias, rel=1e-12)
        assert float(got["rel_rmse"]) == pytest.approx(want.rel_rmse, rel=1e-12)
    report = res.files["report"].read_text()
    assert "## Learning the slopes: slope-gradient bias and variance" in report
    assert "- Slope gradient (n=16, 4 replicates, scheme discrete" in report and "slope_grad.png" in report
    sur = st.row("surrogate", 4)
    assert f"T=4: {sur.rel_bias:.3g} ± {sur.rel_bias_se:.2g}" in report
    found = json.loads(res.files["config"].read_text())["findings"]["slope_grad"]["gaussian"]
    assert found["surrogate"]["4"]["rel_bias"] == pytest.approx(sur.rel_bias, rel=1e-12)
    assert found["score_cells"] == 2
    assert res.slope_grad and res.findings["slope_grad"]["gaussian"]["score"][1]["rel_rmse"] > 0


def test_section_skipped_with_no_samples(tmp_path):
    res = run_validation(_tiny(tmp_path, slope_grad_samples=(), plots=False))
    assert read_csv(res.files["slope_grad"]) == [] and "slope_grad" not in res.findings
    assert "Learning the slopes" not in res.files["report"].read_text()


def test_slope_grad_only_from_the_command_line(tmp_path, capsys):
    cfg = _tiny(tmp_path / "only", slope_grad_only=True, slope_grad_scheme="gamma", slope_grad_fd_step=0.0)
    line = command_line(cfg)
    assert "--slope-grad-only" in line and "--slope-grad-scheme gamma" in line
    assert main([*shlex.split(line)[1:], "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "slope_grad.md" in out and "Slope gradient (n=16, 4 replicates, scheme gamma" in out
    d = tmp_path / "only"
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "slope_grad.csv", "slope_grad.md", "slope_grad.png"]
    rows = read_csv(d / "slope_grad.csv")
    assert {r["estimator"] for r in rows} == {"surrogate", "score"}  # no finite differences with step 0
    assert {r["scheme"] for r in rows} == {"gamma"}
    assert "| T | surrogate bias |" in (d / "slope_grad.md").read_text()
    meta = json.loads((d / "config.json").read_text())
    assert meta["config"]["slope_grad_only"] is True and "slope_grad" in meta["findings"]


def test_model_input_is_the_last_layer_cropped_with_the_model_slopes(tmp_path):
    cfg = _tiny(tmp_path, source="checkpoint", checkpoint="/nowhere", text="/nowhere.txt", slope_grad_len=12)
    layers = [LayerQKV(i, *(torch.randn(1, 3, 40, 4) for _ in range(3))) for i in range(2)]
    short = Context(0, 20, [LayerQKV(i, *(torch.randn(1, 3, 20, 4) for _ in range(3))) for i in range(2)])
    slopes = torch.tensor([0.5, 0.25, 0.1], dtype=torch.float64)
    gauss, model = slope_grad_inputs(cfg, [short, Context(0, 40, layers)], slopes, 0.3)
    assert gauss.label == "gaussian" and gauss.q.shape == (1, 2, 12, 8)
    assert model.label == "checkpoint" and model.scale == 0.3
    assert torch.equal(model.q, layers[1].q[:, :, :12]) and torch.equal(model.v, layers[1].v[:, :, :12])
    assert torch.equal(model.slopes, slopes)
    _, plain = slope_grad_inputs(cfg, [Context(0, 40, layers)], None, None)  # no ALiBi: the standard schedule
    torch.testing.assert_close(plain.slopes, alibi_slopes(3).double())
    assert len(slope_grad_inputs(_tiny(tmp_path), [Context(0, 40, layers)], slopes, None)) == 1  # synthetic


def test_shipped_model_input(tmp_path):
    try:
        from positional_lsh.lm import load_shipped_model

        load_shipped_model()
    except (ImportError, FileNotFoundError):
        pytest.skip("the shipped model is not available")
    cfg = _tiny(tmp_path, source="shipped", slope_grad_only=True, slope_grad_samples=(2,), slope_grad_len=12,
                slope_grad_replicates=2, plots=False)  # fmt: skip
    res = run_validation(cfg)
    ship = [r for r in res.slope_grad if r["inputs"] == "shipped" and r["head"] >= 0]
    assert sorted({r["slope"] for r in ship}) == pytest.approx([2.0**-i for i in range(8, 0, -1)])
    assert all(math.isfinite(r["exact"]) for r in ship)
    assert "shipped" in (tmp_path / "slope_grad.md").read_text()
    # the section's input is what the theory room's shipped_qkv captures: the same exact gradient
    qkv, slopes = shipped_qkv(12)
    w = loss_weight(qkv.q.shape, derive_seed(0, "slope-grad", "shipped"))
    g = exact_slope_gradient(qkv.q, qkv.k, qkv.v, slopes, w)
    exact = [r["exact"] for r in sorted(ship, key=lambda r: r["head"]) if r["estimator"] == "surrogate"]
    assert exact == pytest.approx(g.tolist(), rel=1e-6)


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(slope_grad_replicates=1), "slope_grad_replicates"),
        (dict(slope_grad_len=1), "slope_grad_len"),
        (dict(slope_grad_samples=(0,)), "slope_grad_samples"),
        (dict(slope_grad_samples=(4, 4)), "slope_grad_samples must be distinct"),
        (dict(slope_grad_scheme="nope"), "unknown scheme"),
        (dict(slope_grad_fd_step=1.0), "slope_grad_fd_step"),
        (dict(slope_grad_fd_step=-0.1), "slope_grad_fd_step"),
        (dict(slope_grad_only=True, slope_grad_samples=()), "slope_grad_only"),
    ],
)
def test_bad_settings(tmp_path, kw, word):
    with pytest.raises(ValueError, match=word):
        _tiny(tmp_path, **kw)


@pytest.mark.parametrize(
    "flags, word",
    [
        (["--slope-grad-replicates", "1"], "slope_grad_replicates"),
        (["--slope-grad-len", "1"], "slope_grad_len"),
        (["--slope-grad-fd-step", "2"], "slope_grad_fd_step"),
        (["--slope-grad-scheme", "nope"], "unknown scheme"),
        (["--slope-grad-only", "--slope-grad-samples", "none"], "slope_grad_only"),
    ],
)
def test_bad_flags_are_one_line_and_touch_nothing(tmp_path, capsys, flags, word):
    out = tmp_path / "never"
    assert main(["validate", "--out", str(out), "--source", "synthetic", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plsh validate: error:") and word in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_unparseable_flag_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--out", str(tmp_path / "x"), "--slope-grad-samples", "4,x"])
    assert exc.value.code == 2 and "--slope-grad-samples" in capsys.readouterr().err
