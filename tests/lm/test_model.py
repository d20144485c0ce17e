"""Tests for positional_lsh.lm (config, model, checkpoint): position modes, references, generation, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from positional_lsh.lm import data as D
from positional_lsh.lm.checkpoint import is_checkpoint, load_checkpoint, save_checkpoint, shipped_checkpoint_path
from positional_lsh.lm.config import POSITIONS, ModelConfig
from positional_lsh.lm.model import TransformerLM, apply_rope, rope_cos_sin

from conftest import TINY_LM as TINY
from conftest import lm_ids as ids
from conftest import naive_alibi
from conftest import tiny_lm as tiny


def dense_reference_logits(model: TransformerLM, x: torch.Tensor, window: torch.Tensor | None = None) -> torch.Tensor:
    """The model's forward with attention replaced by an explicit float64 n x n ALiBi bias (conftest.naive_alibi)."""
    cfg = model.cfg
    h = model.embed(x).double()
    for block in model.blocks:
        a = block.attn
        z = block.norm1(h)
        b, n, c = z.shape
        q, k, v = a.qkv(z).view(b, n, 3, cfg.n_head, cfg.head_dim).permute(2, 0, 3, 1, 4)
        y = naive_alibi(q, k, v, cfg.slopes(), causal=True, window=window)
        h = h + a.proj(y.transpose(1, 2).reshape(b, n, c))
        h = h + block.mlp(block.norm2(h))
    return model.head(model.norm(h))


# --------------------------------------------------------------------------------------------------
# Every mode runs forward and backward
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS)
def test_every_mode_forward_backward(position: str) -> None:
    model = tiny(position, num_samples=2, window=6.0 if position == "window-alibi" else None).train()
    x = ids()
    logits, loss = model(x, torch.roll(x, -1, dims=1))
    assert logits.shape == (2, 24, TINY["vocab_size"]) and logits.dtype == torch.float32
    value = loss.item()
    assert math.isfinite(value) and abs(value - math.log(TINY["vocab_size"])) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("position", POSITIONS)
def test_every_mode_under_bf16_autocast(position: str) -> None:
    model = tiny(position, num_samples=2).train()
    x = ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, x)
    loss.backward()
    assert logits.dtype == torch.float32 and math.isfinite(loss.item())


def test_state_dict_does_not_depend_on_position() -> None:
    keys = {tuple(tiny(p).state_dict()) for p in POSITIONS}
    assert len(keys) == 1


# --------------------------------------------------------------------------------------------------
# Exact references
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "chunked"])
def test_alibi_equals_dense_reference(impl: str) -> None:
    model = tiny("alibi", alibi_impl=impl).double().eval()
    x = ids(length=40)
    ref = dense_reference_logits(model, x)
    torch.testing.assert_close(model(x).double(), ref.float().double(), rtol=1e-5, atol=1e-5)


def test_alibi_constant_sigma_and_window_equal_dense_reference() -> None:
    model = tiny("window-alibi", sigma=4.0, window=5.0).double().eval()
    x = ids(length=30)
    ref = dense_reference_logits(model, x, window=torch.full((4,), 5.0))
    torch.testing.assert_close(model(x).double(), ref.float().double(), rtol=1e-5, atol=1e-5)
    model.set_position("alibi")
    assert not torch.allclose(model(x).double(), ref.float().double(), atol=1e-3)  # the window matters


def test_alibi_gradients_match_dense_reference() -> None:
    model = tiny("alibi").double()
    x = ids(length=20)
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    loss_ref = F.cross_entropy(dense_reference_logits(model, x).flatten(0, 1), x.flatten())
    grads_ref = torch.autograd.grad(loss_ref, list(model.parameters()))
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-8)


def test_slope_zero_is_nope() -> None:
    """sigma = inf (slope 0): ALiBi and positional LSH (one block, any T) are plain causal attention."""
    x = ids(length=33)
    nope = tiny("nope").eval()
    ref = nope(x)
    for position in ("alibi", "plsh"):
        nope.set_position(position, sigma=math.inf, num_samples=3)
        torch.testing.assert_close(nope(x), ref, rtol=1e-5, atol=1e-5)


def test_plsh_approaches_alibi_with_many_samples() -> None:
    model = tiny("alibi").double().eval()
    x = ids(length=48)
    exact = torch.log_softmax(model(x).double(), -1)
    errors = []
    for t in (2, 32, 512):
        model.set_position("plsh", num_samples=t, eval_seed=1)
        with torch.no_grad():
            errors.append(float((torch.log_softmax(model(x).double(), -1) - exact).abs().max()))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.1 * errors[0]  # the error falls about like 1 / sqrt(T)
    assert errors[2] < 0.01


def test_plsh_partitions_fresh_in_training_fixed_in_eval() -> None:
    model = tiny("plsh", num_samples=1)
    x = ids()
    model.eval()
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
    model.train()
    a, b = model(x), model(x)
    assert not torch.allclose(a, b)
    # the training partitions are reproducible from the seed
    other = tiny("plsh", num_samples=1).train()
    torch.testing.assert_close(other(x), a, rtol=0, atol=0)


def test_rng_state_round_trip() -> None:
    model = tiny("plsh", num_samples=2).train()
    x = ids()
    state = model.rng_state()
    a = model(x)
    model.set_rng_state(state)
    torch.testing.assert_close(model(x), a, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one entry per layer"):
        model.set_rng_state(state[:1])


def test_rope_depends_on_relative_position_only() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 8, generator=g).double()

    def score(m: int, n: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([m]), 8, 10000.0, torch.float64)
        ck, sk = rope_cos_sin(torch.tensor([n]), 8, 10000.0, torch.float64)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-9)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
    cq, sq = rope_cos_sin(torch.tensor([0]), 8, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rope(q, cq, sq), q)  # position 0 is the identity


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS)
def test_generate_with_cache_equals_recomputation(position: str) -> None:
    model = tiny(position, num_samples=3, window=5.0 if position == "window-alibi" else None)
    prompt = ids(batch=2, length=7)
    a = model.generate(prompt, 12, temperature=0.0, use_cache=True)
    b = model.generate(prompt, 12, temperature=0.0, use_cache=False)
    assert a.shape == (2, 19) and torch.equal(a[:, :7], prompt)
    assert torch.equal(a, b)
    # the cached logits equal the full forward, position by position
    full = model(a)
    _, cache = model.forward_with_cache(a[:, :10])
    step, _ = model.forward_with_cache(a[:, 10:11], cache)
    torch.testing.assert_close(step[:, 0], full[:, 10], rtol=1e-4, atol=1e-4)


def test_plsh_generate_decodes_through_the_kvcache_entry_point(monkeypatch) -> None:
    # Every decoded token of every layer is one call of the op layer's KV-cache entry point, with the layer's one
    # DecodeState and the model's backend and method; the prompt is the module's plsh_attention call.
    import positional_lsh.lm.model as model_module

    calls: list[dict] = []
    real = model_module.plsh_attention_with_kvcache
    spy = lambda *a, **kw: calls.append(kw) or real(*a, **kw)  # noqa: E731
    monkeypatch.setattr(model_module, "plsh_attention_with_kvcache", spy)
    for method in ("auto", "samples"):
        calls.clear()
        model = tiny("plsh", num_samples=3, attn_backend="math", plsh_method=method)
        prompt = ids(batch=2, length=7)
        a = model.generate(prompt, 6, temperature=0.0, use_cache=True)
        assert torch.equal(a, model.generate(prompt, 6, temperature=0.0, use_cache=False))
        assert len(calls) == 5 * model.cfg.n_layer  # the first new token comes from the prompt's call
        assert {(c["backend"], c["method"]) for c in calls} == {("math", method)}
        states = {id(c["state"]) for c in calls}
        assert states == {id(block.attn._decode_state) for block in model.blocks}


def test_generate_sampling_is_seeded_and_stops() -> None:
    model = tiny("alibi")
    prompt = ids(batch=1, length=5)
    a = model.generate(prompt, 10, top_k=5, generator=3)
    b = model.generate(prompt, 10, top_k=5, generator=3)
    assert torch.equal(a, b)
    first = int(model.generate(prompt, 1, temperature=0.0)[0, -1])
    stopped = model.generate(prompt, 10, temperature=0.0, stop_token=first)
    assert stopped.shape == (1, 6)


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> D.BPETokenizer:
    return D.train_tokenizer(["the quick brown fox jumps over the lazy dog " * 20, "pack my box " * 30], 300)


def test_checkpoint_round_trip(tmp_path, tokenizer: D.BPETokenizer) -> None:
    model = tiny("plsh", num_samples=2, vocab_size=tokenizer.vocab_size, sigma=8.0).eval()
    x = torch.randint(0, tokenizer.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    save_checkpoint(tmp_path / "ck", model, tokenizer, metadata={"note": "hi"})
    assert is_checkpoint(tmp_path / "ck") and not is_checkpoint(tmp_path)
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.model.cfg == model.cfg and not ck.model.training
    assert ck.tokenizer == tokenizer and ck.metadata["note"] == "hi"
    torch.testing.assert_close(ck.model(x), model(x), rtol=0, atol=0)
    assert ck.model.head.weight is ck.model.embed.weight  # still tied
    # a different position mode at load time, same weights
    alibi = load_checkpoint(tmp_path / "ck", position="alibi").model
    assert alibi.cfg.position == "alibi" and torch.equal(alibi.embed.weight, model.embed.weight)


def test_checkpoint_half_storage_loads_float32(tmp_path) -> None:
    model = tiny("alibi").eval()
    x = ids()
    save_checkpoint(tmp_path / "h", model, dtype="float16")
    full = save_checkpoint(tmp_path / "f", model)
    size_h = (tmp_path / "h" / "model.safetensors").stat().st_size
    size_f = (full / "model.safetensors").stat().st_size
    assert size_h < 0.6 * size_f
    ck = load_checkpoint(tmp_path / "h")
    assert ck.tokenizer is None and ck.model.embed.weight.dtype == torch.float32
    torch.testing.assert_close(ck.model(x), model(x), rtol=0, atol=2e-3)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["weights_dtype"] == "float16"


def test_checkpoint_bad_input(tmp_path, tokenizer: D.BPETokenizer) -> None:
    model = tiny("alibi")
    with pytest.raises(ValueError, match="dtype"):
        save_checkpoint(tmp_path / "x", model, dtype="int8")
    with pytest.raises(TypeError, match="model"):
        save_checkpoint(tmp_path / "x", "model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokenizer has"):
        save_checkpoint(tmp_path / "x", model, tokenizer)  # 300 ids > 97
    with pytest.raises(ValueError, match="not a directory"):
        load_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "empty")
    save_checkpoint(tmp_path / "ok", model)
    with pytest.raises(ValueError, match="unknown model config keys"):
        load_checkpoint(tmp_path / "ok", not_a_field=1)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"position": "learned"}, ValueError, "position"),
        ({"d_model": 30}, ValueError, "multiple of n_head"),
        ({"n_layer": 0}, ValueError, "n_layer"),
        ({"n_head": 2.0}, TypeError, "n_head"),
        ({"scheme": "uniform"}, ValueError, "scheme"),
        ({"sigma": -1.0}, ValueError, "sigma"),
        ({"window": [1.0, 2.0]}, ValueError, "one entry per head"),
        ({"dropout": 1.0}, ValueError, "dropout"),
        ({"position": "rope", "n_head": 32}, ValueError, "even head dimension"),
        ({"alibi_impl": "flex"}, ValueError, "alibi_impl"),
        ({"attn_fp32": "yes"}, TypeError, "attn_fp32"),
        ({"attn_backend": "cuda"}, ValueError, "attn_backend"),
        ({"plsh_method": "blocks"}, ValueError, "plsh_method"),
        ({"seed": -1}, ValueError, "seed"),
        ({"eval_seed": 1.0}, TypeError, "eval_seed"),
        ({"position": "alibi", "attn_backend": "triton"}, ValueError, "attn_backend='triton'.*no Triton path"),
        ({"position": "window-alibi", "attn_backend": "triton", "alibi_impl": "chunked"}, ValueError, "attn_backend"),
    ],
)
def test_config_bad_input(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        ModelConfig(**{**TINY, **kw})


def test_config_backends_and_methods_are_the_op_layer_options() -> None:
    from positional_lsh.ops.options import BACKENDS, METHODS

    for backend in BACKENDS:  # positional LSH takes every backend, triton included
        assert ModelConfig(**{**TINY, "position": "plsh", "attn_backend": backend}).attn_backend == backend
    for method in METHODS:
        assert ModelConfig(**{**TINY, "position": "plsh", "plsh_method": method}).plsh_method == method
    # exact ALiBi through SDPA never reaches alibi_attention, so triton is accepted there
    sdpa = ModelConfig(**{**TINY, "position": "alibi", "attn_backend": "triton", "alibi_impl": "sdpa"})
    assert sdpa.attn_backend == "triton"
    # switching a triton plsh config to exact ALiBi is refused at the switch, naming the field
    plsh = ModelConfig(**{**TINY, "position": "plsh", "attn_backend": "triton"})
    with pytest.raises(ValueError, match="attn_backend"):
        ModelConfig(**{**plsh.to_dict(), "position": "alibi"})


def test_forward_and_generate_bad_input() -> None:
    model = tiny("alibi")
    with pytest.raises(TypeError, match="idx"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="idx"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        model(torch.full((1, 4), 97))
    with pytest.raises(ValueError, match="targets"):
        model(ids(), ids()[:, :3])
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids(), -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(ids(), 2, temperature=-1.0)
    with pytest.raises(TypeError, match="generator"):
        model.generate(ids(), 2, generator="seed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not position settings"):
        model.set_position("plsh", d_model=64)
    with pytest.raises(ValueError, match="position"):
        model.set_position("relative")
    with pytest.raises(TypeError, match="ModelConfig"):
        TransformerLM({"position": "alibi"})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Where the names live
# --------------------------------------------------------------------------------------------------


def test_public_lm_names() -> None:
    import positional_lsh
    import positional_lsh.lm as lm
    from positional_lsh.lm import checkpoint, config, model

    assert lm.ModelConfig is config.ModelConfig and lm.TransformerLM is model.TransformerLM
    for name in ("load_checkpoint", "load_shipped_model", "save_checkpoint"):
        assert getattr(lm, name) is getattr(checkpoint, name)
    for name in ("ModelConfig", "TransformerLM", "load_checkpoint", "load_shipped_model"):
        assert getattr(positional_lsh, name) is getattr(lm, name)  # lazily re-exported
    homes = {**vars(config), **vars(model), **vars(checkpoint)}
    for name in lm.__all__:  # each public lm name is the object of its home module
        assert getattr(lm, name) is homes[name], name


@pytest.mark.skipif(not (shipped_checkpoint_path() / "model.safetensors").is_file(), reason="no shipped model")
def test_shipped_model_loads_with_positional_lsh() -> None:
    from positional_lsh.lm import load_shipped_model

    ck = load_shipped_model(position="plsh", num_samples=2)
    assert ck.model.cfg.position == "plsh" and not ck.model.training
    assert ck.tokenizer is not None and ck.tokenizer.vocab_size <= ck.model.cfg.vocab_size


# ------------------------------------------------------------------ issue 16: one sampling policy, compile


def test_layer_partitions_follow_the_one_policy() -> None:
    # Layer l's eval partitions are drawn from layer_seed(eval_seed, l), training call c from
    # layer_seed(layer_seed(seed, l), c); the seeds are computed here from the formula, not by the library.
    from positional_lsh import plsh_attention, sample_partitions

    def formula(seed: int, key: int) -> int:
        return (seed * 1_000_003 + key * 7_919 + 1) % 2**62

    model = tiny("plsh", num_samples=3, seed=5, eval_seed=9)
    attn = model.blocks[1].attn
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, attn.n_head, 20, attn.head_dim, generator=g) for _ in range(3))
    model.eval()
    want = sample_partitions(20, attn.slopes, 3, generator=formula(9, 1))
    torch.testing.assert_close(attn.attend(q, k, v), plsh_attention(q, k, v, partitions=want), rtol=0, atol=0)
    model.train()
    for c in range(3):
        want = sample_partitions(20, attn.slopes, 3, generator=formula(formula(5, 1), c))
        torch.testing.assert_close(attn.attend(q, k, v), plsh_attention(q, k, v, partitions=want), rtol=0, atol=0)
    assert model.rng_state()[1] == 3 and model.rng_state()[0] == 0
    with pytest.raises(TypeError, match="states must be an int"):
        model.set_rng_state([0, "x"] + [0] * (len(model.blocks) - 2))


def test_plsh_layer_is_the_library_module() -> None:
    # Each plsh layer's attention is a PositionalLSHAttention with the layer's seeds, kept out of the state dict;
    # set_position rebuilds it in the layer's train/eval mode, keeping its step while the layer stays plsh.
    from positional_lsh import PositionalLSHAttention
    from positional_lsh.distributed import ContextShards
    from positional_lsh.ops.partitions.sampling import layer_seed

    model = tiny("plsh", num_samples=3, seed=5, eval_seed=9).train()
    x = ids()
    for i, block in enumerate(model.blocks):
        attn = block.attn.plsh
        assert isinstance(attn, PositionalLSHAttention) and not attn.persistent
        assert (attn.num_samples, attn.sampler.seed, attn.sampler.eval_seed) == (3, layer_seed(5, i), layer_seed(9, i))
    model(x), model(x)
    assert model.rng_state() == [2, 2]
    model.eval()
    model.set_position("plsh", num_samples=4)
    assert model.rng_state() == [2, 2] and not any(b.attn.plsh.training for b in model.blocks)
    fresh = tiny("plsh", num_samples=4, seed=5, eval_seed=9).eval()  # the same weights
    torch.testing.assert_close(model(x), fresh(x), rtol=0, atol=0)  # eval partitions, not training draws
    model.train().set_position("alibi")
    assert all(b.attn.plsh is None for b in model.blocks) and model.rng_state() == [0, 0]
    model.set_rng_state([0, 0])
    with pytest.raises(ValueError, match="layer 0, which has no positional-LSH attention"):
        model.set_rng_state([3, 0])
    with pytest.raises(ValueError, match="context parallelism supports position='plsh' only, got 'alibi'"):
        model(x, context=ContextShards(None, shard_lengths=[24]))


LAYER_WEIGHTS = ("norm1.weight", "attn.qkv.weight", "attn.proj.weight", "norm2.weight", "mlp.fc.weight",
                 "mlp.proj.weight")  # fmt: skip


@pytest.mark.parametrize("position", POSITIONS)
def test_state_dict_layout_is_unchanged(position: str) -> None:
    # The layout every earlier version wrote: the weights (and learned log-slopes) only; the attention module's
    # step and slopes are not in it (the step is in the run directory's rng state, the slopes in the config).
    keys = ["embed.weight"] + [f"blocks.{i}.{n}" for i in range(2) for n in LAYER_WEIGHTS] + ["norm.weight"]
    assert list(tiny(position, num_samples=2).state_dict()) == [*keys, "head.weight"]
    if position in ("alibi", "window-alibi", "plsh"):
        learned = tiny(position, num_samples=2, learn_slopes=True).state_dict()
        assert set(learned) == {*keys, "head.weight", "blocks.0.attn.log_slopes", "blocks.1.attn.log_slopes"}


# Logits [0, -1, :3] of the shipped model on randint(0, 8192, (1, 300), seed 0), computed with the language model's
# attention before it became PositionalLSHAttention (same checkpoint files): eval plsh T=2, then two training calls.
SHIPPED_PLSH = [-4.199948310852051, 1.8793147802352905, 0.5406042337417603]
SHIPPED_TRAIN = ([-4.207526683807373, 0.41001853346824646, -0.04191581904888153],
                 [-3.864935874938965, 1.1733335256576538, -0.23710787296295166])  # fmt: skip


@pytest.mark.skipif(not (shipped_checkpoint_path() / "model.safetensors").is_file(), reason="no shipped model")
def test_shipped_checkpoint_loads_unchanged_to_the_same_logits() -> None:
    from safetensors.torch import load_file

    stored = load_file(str(shipped_checkpoint_path() / "model.safetensors"))
    cfg = json.loads((shipped_checkpoint_path() / "config.json").read_text())["model"]
    model = TransformerLM(ModelConfig(**{**cfg, "position": "plsh", "num_samples": 2}))
    model.load_state_dict({**stored, "head.weight": stored["embed.weight"]}, strict=True)  # the files as shipped
    x = torch.randint(0, 8192, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x)[0, -1, :3].tolist(), SHIPPED_PLSH, rtol=0, atol=1e-5)
        model.train()
        for want in SHIPPED_TRAIN:
            torch.testing.assert_close(model(x)[0, -1, :3].tolist(), want, rtol=0, atol=1e-5)
    assert model.rng_state() == [2] * 4


@pytest.mark.parametrize("position", ["plsh", "alibi"])
def test_model_compiles_fullgraph_for_eval_and_a_training_step(position: str) -> None:
    torch._dynamo.reset()
    x = ids(2, 24)
    eager, comp = tiny(position, num_samples=2, seed=3), tiny(position, num_samples=2, seed=3)
    compiled = torch.compile(comp, fullgraph=True)
    eager.eval(), comp.eval()
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    # Training steps: the compiled model draws the same fresh partitions as the eager one, step after step.
    eager.train(), comp.train()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, comp)]
    for _ in range(2):
        losses = []
        for fn, opt in zip((eager, compiled), opts, strict=True):
            logits = fn(x)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    assert comp.rng_state() == eager.rng_state() == [2 if position == "plsh" else 0] * len(comp.blocks)
    for a, b in zip(eager.parameters(), comp.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="out of range"):  # the ids' range is checked inside the graph
        compiled(x + TINY["vocab_size"])


@pytest.mark.parametrize("position", ["plsh", "alibi", "window-alibi"])
def test_model_compiles_one_graph_for_every_length_with_dynamic_shapes(position: str) -> None:
    """Issue 34 item 1: ``dynamic=True`` training steps at three lengths trace one graph (before: the ALiBi layers'
    bias cache, keyed by the sizes, recompiled at every length, and window-alibi's key read the window with
    ``tolist()``, which a trace cannot), with eager mode's logits and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    window = 6.0 if position == "window-alibi" else None
    eager, comp = (tiny(position, num_samples=2, seed=3, window=window).train() for _ in range(2))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(comp, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for n in (12, 20, 33):
        x = ids(2, n)
        got, want = compiled(x), eager(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.square().mean().backward()
        want.square().mean().backward()
        for a, b in zip(comp.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], frames


@pytest.mark.skipif(not (shipped_checkpoint_path() / "model.safetensors").is_file(), reason="no shipped model")
def test_shipped_model_reported_figures_are_unchanged() -> None:
    # docs/experiments.md, the sweep on the shipped model (`plsh eval runs/lm/alibi --factors 1,4,16 --stride window
    # --max-tokens 8192 --samples 1,4,16,64 ...`), window of 1x the training length: own exact ALiBi 132.01,
    # plsh T=1 discrete 247.34, T=4 discrete 165.02, T=4 gamma 153.86 (perplexity, 2 decimals as reported).
    from positional_lsh.lm import evaluate as E

    kw = dict(data=None, split="test", train_len=None, tokenizer=None, cache_dir=None, seed=0)
    adapter, stream = E.load_for_eval(None, label="alibi", device=torch.device("cpu"), **kw)
    run = dict(stride="window", max_tokens=8192, equal_cost=False, progress=False)
    # The sweep's rows, less T=1 gamma (not reported): own + T=4 both schemes, then T=1 discrete alone (no own row:
    # factors=(), the sweep at sweep_factors). Each row is the same number as in the one sweep (same seeds).
    rows = E.evaluate_model(adapter, stream, factors=(1,), samples=(4,), schemes=("discrete", "gamma"), **run)
    one = dict(factors=(), sweep_factors=(1,), samples=(1,), schemes=("discrete",))
    rows += E.evaluate_model(adapter, stream, **one, **run)
    got = {r.attention: round(r.ppl, 2) for r in rows}
    assert len(got) == 4
    assert got["own: alibi"] == 132.01
    assert got["plsh T=1 discrete"] == 247.34
    assert got["plsh T=4 discrete"] == 165.02
    assert got["plsh T=4 gamma"] == 153.86
