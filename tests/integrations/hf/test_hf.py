"""transformers integration (positional_lsh.integrations.hf): tiny random-initialized models, nothing downloaded."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BloomConfig,
    FalconConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MptConfig,
    Qwen2Config,
    Qwen3Config,
)

from positional_lsh import alibi_slopes  # noqa: E402
from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.ops.exact.bias import alibi_bias  # noqa: E402

V = 97


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    # (conftest.py already runs the tests on one thread.)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


_ROPE_COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def config(name: str, heads: int = 4):
    if name == "bloom":
        return BloomConfig(vocab_size=V, hidden_size=8 * heads, n_layer=2, n_head=heads)
    if name == "mpt":
        return MptConfig(vocab_size=V, d_model=8 * heads, n_layers=2, n_heads=heads, max_seq_len=64)
    if name == "falcon":  # multi-query attention (one key/value head)
        return FalconConfig(
            vocab_size=V,
            hidden_size=8 * heads,
            num_hidden_layers=2,
            num_attention_heads=heads,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=True,
        )
    if name == "falcon-gqa":  # the new decoder architecture, grouped key/value heads
        return FalconConfig(
            vocab_size=V,
            hidden_size=8 * heads,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_kv_heads=2,
            alibi=True,
            new_decoder_architecture=True,
        )
    if name == "llama":
        return LlamaConfig(**_ROPE_COMMON)
    if name == "mistral":
        return MistralConfig(**_ROPE_COMMON, sliding_window=8)
    if name == "qwen2":
        return Qwen2Config(**_ROPE_COMMON)
    if name == "qwen3":
        return Qwen3Config(**_ROPE_COMMON)
    raise AssertionError(name)


def tiny(name: str, *, heads: int = 4, dtype: torch.dtype = torch.float64, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config(name, heads)), **kwargs)  # from_config mutates
    model.generation_config.pad_token_id = 0
    return model.eval().to(dtype)


def ids(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x, **kwargs) -> torch.Tensor:
    return model(x, **kwargs).logits


# ------------------------------------------------------------------------------------------------
# Exact mode equals transformers' own output
# ------------------------------------------------------------------------------------------------

# BLOOM and MPT take their softmax in float32 even for float64 models; Falcon's sdpa path is float64.
_NATIVE_TOL = {"bloom": 1e-6, "mpt": 1e-6, "falcon": 1e-11, "falcon-gqa": 1e-11}


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon", "falcon-gqa"])
def test_exact_alibi_equals_transformers(name):
    model = tiny(name, attn_implementation="sdpa" if name.startswith("falcon") else None)
    x = ids()
    ref = logits(model, x)
    with hf.use_alibi(model) as swap:
        assert swap.family == name.split("-")[0] and swap.mode == "alibi"
        out = logits(model, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=_NATIVE_TOL[name])
    assert torch.equal(logits(model, x), ref)  # restored: bit-identical to the original


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_exact_alibi_left_padding_equals_transformers(name):
    # float32: in float64, transformers' BLOOM and MPT themselves return NaN for left-padded batches.
    model = tiny(name, dtype=torch.float32)
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    ref = logits(model, x, attention_mask=mask)
    with hf.use_alibi(model):
        out = logits(model, x, attention_mask=mask)
        alone = logits(model, x[1:, 7:])
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1, 7:], ref[1, 7:], rtol=0, atol=1e-5)  # the valid positions
    torch.testing.assert_close(out[1, 7:], alone[0], rtol=0, atol=1e-5)  # = the row without its padding


def test_mpt_beyond_max_seq_len():
    model = tiny("mpt")
    x = ids(batch=1, length=80)  # config max_seq_len = 64
    with pytest.raises(RuntimeError):
        logits(model, x)
    with hf.use_alibi(model):
        assert torch.isfinite(logits(model, x)).all()


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_exact_alibi_non_power_of_two_heads(name):
    # 6 heads: the interleaved slope schedule, read from the model's own code (float32 products there).
    model = tiny(name, heads=6)
    x = ids(length=30)
    ref = logits(model, x)
    with hf.use_alibi(model):
        out = logits(model, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_falcon_convention_and_eager_double_bias():
    # Falcon adds slope*j before dividing by sqrt(d): effective slope m / sqrt(d) (its sdpa path).
    model = tiny("falcon", attn_implementation="sdpa")
    swap = hf.use_alibi(model)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    torch.testing.assert_close(swap.slopes, alibi_slopes(4).double() / head_dim**0.5, rtol=0, atol=0)
    swap.restore()
    # transformers 5.24's eager path adds it twice (2 m / sqrt(d)); we follow sdpa, documented in docs/hf.md.
    eager = tiny("falcon", attn_implementation="eager")
    x = ids(length=24)
    ref_eager = logits(eager, x)
    with hf.use_alibi(eager, slopes=2 * swap.slopes):
        doubled = logits(eager, x)
    if not torch.allclose(doubled, ref_eager, rtol=0, atol=1e-11):
        pytest.skip("this transformers version's Falcon eager path no longer doubles the ALiBi bias")


def _stock_attention_inputs(model, attn: torch.nn.Module, x: torch.Tensor) -> dict:
    """The arguments the stock model passes to one attention module's forward (bound by parameter name)."""
    got: dict = {}

    def hook(mod, args, kwargs):
        got.update(inspect.signature(mod.forward).bind(*args, **kwargs).arguments)

    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        logits(model, x)
    finally:
        handle.remove()
    return got


def _stock_slopes(name: str, model) -> torch.Tensor:
    """The per-key slope of the bias the stock attention receives, in this library's convention (float64)."""
    x = ids(batch=1, length=5)
    if name == "bloom":  # alibi (B*H, 1, n) = m * j, added after scaling
        alibi = _stock_attention_inputs(model, model.transformer.h[0].self_attention, x)["alibi"]
        return (alibi[:, 0, 1] - alibi[:, 0, 0]).double()
    if name == "mpt":  # position_bias (H, 1, max_seq_len) = m * (j - (max_seq_len - 1)), added after scaling
        bias = _stock_attention_inputs(model, model.transformer.blocks[0].attn, x)["position_bias"]
        return (bias[:, 0, -1] - bias[:, 0, -2]).double()
    # Falcon (sdpa): the mask holds alibi / sqrt(d), the scaled bias (its rows: keys of the last query).
    mask = _stock_attention_inputs(model, model.transformer.h[0].self_attention, x)["attention_mask"]
    return (mask[0, :, -1, 1] - mask[0, :, -1, 0]).double()


@pytest.mark.parametrize(
    "name, heads, kwargs",
    [
        ("bloom", 4, {}),
        ("bloom", 6, {}),
        ("mpt", 4, {}),
        ("mpt", 6, {"alibi_bias_max": 4}),  # the stock MptModel ignores it (it always uses the default 8)
        ("falcon", 4, {}),
        ("falcon", 6, {}),
        ("falcon-gqa", 4, {}),
    ],
)
def test_native_slopes_capture_and_swap_agree_with_the_stock_model(name, heads, kwargs):
    # One function (integrations.families.native_slopes) gives the slopes to the swap and to capture; they are
    # what the stock model's own attention adds, read here from the arguments it receives (float32 model).
    from positional_lsh.theory.capture import model_alibi_slopes

    cfg = config(name, heads)
    if kwargs:
        cfg.attn_config.alibi_bias_max = kwargs["alibi_bias_max"]
    torch.manual_seed(0)
    impl = "sdpa" if name.startswith("falcon") else None
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    captured = model_alibi_slopes(model)
    with hf.use_alibi(model) as swap:
        swapped = swap.slopes
    assert captured is not None and captured.dtype == torch.float64 and captured.shape == (heads,)
    assert torch.equal(captured, swapped)
    stock = _stock_slopes(name.split("-")[0], model)
    # BLOOM / MPT: float32 products m * 1, exact. Falcon: bf16(m) / sqrt(d) rounded once to float32.
    tol = 1e-6 if name.startswith("falcon") else 0.0
    torch.testing.assert_close(captured, stock, rtol=tol, atol=0)
    if name == "mpt":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        torch.testing.assert_close(captured, alibi_slopes(heads).double(), rtol=0, atol=0)
        if kwargs:  # the config's value would give other slopes; the stock model does not use them
            assert not torch.allclose(captured, -build_mpt_alibi_tensor(heads, 2, 4)[:, 0, 0].double())
    if name.startswith("falcon"):  # bfloat16-rounded slopes, divided by sqrt(head_dim)
        d = model.config.hidden_size // heads
        bf16 = alibi_slopes(heads).bfloat16().double()
        torch.testing.assert_close(captured, bf16 / d**0.5, rtol=1e-15, atol=0)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen3"])
def test_rope_family_alibi_equals_transformers_eager(name):
    # Reference through transformers' own eager attention: RoPE neutralized independently (inv_freq = 0, so
    # cos = 1 and sin = 0) and the ALiBi bias passed as a per-head 4-D additive mask.
    model = tiny(name)
    ref_model = tiny(name, attn_implementation="eager")
    ref_model.model.rotary_emb.inv_freq.zero_()
    x = ids(length=33)
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.02], dtype=torch.float64)
    bias = alibi_bias(33, 33, slopes, causal=True, dtype=torch.float64)[None]  # (1, H, n, n)
    ref = logits(ref_model, x, attention_mask=bias)
    before = logits(model, x)
    with hf.use_alibi(model, slopes=slopes):
        out = logits(model, x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)  # eager takes its softmax in float32
    assert torch.equal(logits(model, x), before)


def test_windowed_alibi():
    model = tiny("llama")
    x = ids(length=48)
    with hf.use_alibi(model, slopes=0.5):
        exact = logits(model, x)
    with hf.use_alibi(model, slopes=0.5, window=47):  # window covering every distance: exact
        full = logits(model, x)
    with hf.use_alibi(model, slopes=0.5, window=40):  # dropped weights <= e^{-20}
        wide = logits(model, x)
    with hf.use_alibi(model, slopes=0.5, window=2):
        narrow = logits(model, x)
    torch.testing.assert_close(full, exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(wide, exact, rtol=0, atol=1e-7)
    assert (narrow - exact).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------------
# Positional LSH approaches exact as T grows
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_plsh_approaches_exact(name):
    # Error e_s(T) = ||logits_T - logits_exact|| / ||logits_exact - logits_nope|| (relative to the whole
    # positional effect), i.i.d. over partition seeds s. Monte-Carlo error decays like 1/sqrt(T): measured
    # e*sqrt(T) ~ 1.1-1.4 (T = 4..256) with ~15-20% spread across seeds, so the 6-seed mean has ~8% standard
    # error. Expected mean ratio e(4)/e(64) ~ 4-5; we require > 2.5 and e(64) < 0.25 (measured 0.13-0.14).
    model = tiny(name)
    x = ids(length=64)
    with hf.use_alibi(model):
        exact = logits(model, x)
    with hf.use_alibi(model, slopes=0.0):
        nope = logits(model, x)
    scale = (exact - nope).norm()

    def mean_error(t: int) -> float:
        errs = []
        for seed in range(6):
            with hf.use_positional_lsh(model, num_samples=t, seed=seed):
                errs.append(((logits(model, x) - exact).norm() / scale).item())
        return sum(errs) / len(errs)

    e4, e64 = mean_error(4), mean_error(64)
    assert e4 / e64 > 2.5, (e4, e64)
    assert e64 < 0.25, e64


def test_plsh_layer_equals_library_with_same_partitions():
    # One layer's attention through the swap equals plsh_attention with the swap's partitions for that layer.
    from positional_lsh import plsh_attention

    model = tiny("llama")
    x = ids(length=40)
    captured = {}
    attn = model.model.layers[1].self_attn
    hooks = [
        getattr(attn, p).register_forward_hook(lambda mod, a, out, p=p: captured.__setitem__(p, out))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    hooks.append(attn.o_proj.register_forward_pre_hook(lambda mod, a: captured.__setitem__("ctx", a[0])))
    with hf.use_positional_lsh(model, num_samples=5, seed=3) as swap:
        logits(model, x)
        parts = swap.partitions(1, 40)
    for h in hooks:
        h.remove()

    def heads(t):
        return t.view(2, 40, -1, 8).transpose(1, 2)

    ref = plsh_attention(
        heads(captured["q_proj"]), heads(captured["k_proj"]), heads(captured["v_proj"]), partitions=parts
    )
    torch.testing.assert_close(captured["ctx"], ref.transpose(1, 2).reshape(2, 40, 32), rtol=0, atol=1e-12)


def test_partitions_reproducible_and_independent_per_layer():
    model = tiny("bloom")
    x = ids()
    with hf.use_positional_lsh(model, num_samples=4, seed=7) as swap:
        a = logits(model, x)
        p0, p1 = swap.partitions(0, 10), swap.partitions(1, 10)
    with hf.use_positional_lsh(model, num_samples=4, seed=7):
        b = logits(model, x)
    with hf.use_positional_lsh(model, num_samples=4, seed=8):
        c = logits(model, x)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.equal(p0.pitch, p1.pitch)
    swap = hf.use_positional_lsh(model, num_samples=4, seed=None)
    assert isinstance(swap.seed, int)
    hf.restore(model)


def _seed_formula(seed: int, key: int) -> int:
    """The package's seed formula, written out here independently of
    positional_lsh.ops.partitions.sampling.layer_seed."""
    return (seed * 1_000_003 + key * 7_919 + 1) % 2**62


def test_partitions_follow_the_layer_seed_formula():
    # Eval: layer l draws from layer_seed(seed, l); training step c: from layer_seed(layer_seed(seed, l), c).
    from positional_lsh import sample_partitions

    model = tiny("bloom")
    x = ids(length=12)

    def expected(seed: int, n: int):
        return sample_partitions(1, swap.slopes, 3, scheme="gamma", generator=seed).with_seq_len(n)

    def assert_same(got, want, n):
        assert got.seq_len == n and got.scheme == want.scheme
        assert torch.equal(got.pitch, want.pitch) and torch.equal(got.shift, want.shift)

    with hf.use_positional_lsh(model, num_samples=3, scheme="gamma", seed=11) as swap:
        for layer in (0, 1):
            assert_same(swap.partitions(layer, 17), expected(_seed_formula(11, layer), 17), 17)
        model.train()
        model(x)
        model(x)
        assert swap.step == 2
        for layer in (0, 1):
            want = expected(_seed_formula(_seed_formula(11, layer), 2), 9)
            assert_same(swap.partitions(layer, 9, training=True), want, 9)
            assert_same(swap.partitions(layer, 9), expected(_seed_formula(11, layer), 9), 9)  # eval unchanged
    with hf.use_positional_lsh(model, num_samples=3, scheme="gamma", seed=11, resample_in_training=False) as swap:
        model(x)  # (still in training mode)
        assert swap.step == 1
        for layer in (0, 1):  # no resampling: the eval partitions in training mode too
            assert_same(swap.partitions(layer, 9, training=True), expected(_seed_formula(11, layer), 9), 9)
    model.eval()
    with hf.use_alibi(model) as swap, pytest.raises(ValueError, match="positional-LSH mode"):
        swap.partitions(0, 9)


def test_method_and_backend_are_passed_to_plsh_attention(monkeypatch):
    from positional_lsh.integrations.hf import attention_swap

    calls = []
    original = attention_swap.plsh_attention

    def recording(*args, **kwargs):
        calls.append((kwargs["method"], kwargs["backend"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_swap, "plsh_attention", recording)
    model = tiny("llama")
    x = ids(length=24)
    out = {}
    for method in ("auto", "samples", "multiplicity"):
        calls.clear()
        with hf.use_positional_lsh(model, num_samples=4, seed=3, method=method, backend="math") as swap:
            assert swap.method == method and swap.backend == "math"
            out[method] = logits(model, x)
        assert calls and set(calls) == {(method, "math")}, calls  # every layer's call
    # The two methods compute the same estimator with the same partitions.
    torch.testing.assert_close(out["multiplicity"], out["samples"], rtol=0, atol=1e-10)
    torch.testing.assert_close(out["auto"], out["samples"], rtol=0, atol=1e-10)
    with hf.use_positional_lsh(model, backend="triton") as swap:  # accepted (the kernels need a GPU to run)
        assert swap.backend == "triton" and swap.method == "auto"
    with hf.use_alibi(model) as swap:
        assert swap.method is None and swap.backend == "auto"


# ------------------------------------------------------------------------------------------------
# Generation with a KV cache
# ------------------------------------------------------------------------------------------------


def _generate(model, x, use_cache, **kwargs):
    out = model.generate(
        x,
        max_new_tokens=8,
        do_sample=False,
        use_cache=use_cache,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon", "llama", "mistral", "qwen2", "qwen3"])
def test_generate_with_cache_equals_recomputation(name):
    # Each decoding step's query attends within its own block in every sample (queries aligned to the end of
    # the cached keys); without a cache, every step recomputes the whole sequence with the same partitions.
    model = tiny(name)
    x = ids(length=12)
    with hf.use_positional_lsh(model, num_samples=4, seed=1):
        seq_c, scores_c = _generate(model, x, True)
        seq_n, scores_n = _generate(model, x, False)
    assert seq_c.shape == (2, 20)
    assert torch.equal(seq_c, seq_n)
    torch.testing.assert_close(scores_c, scores_n, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_generate_left_padded_batch(name):
    model = tiny(name)
    x = ids(length=12)
    mask = torch.ones_like(x)
    x[1, :4], mask[1, :4] = 0, 0
    with hf.use_positional_lsh(model, num_samples=4, seed=2):
        seq_c, scores_c = _generate(model, x, True, attention_mask=mask)
        seq_n, scores_n = _generate(model, x, False, attention_mask=mask)
        alone, scores_alone = _generate(model, x[1:, 4:], True)  # the padded row, unpadded
    assert torch.equal(seq_c, seq_n)
    torch.testing.assert_close(scores_c, scores_n, rtol=0, atol=1e-10)
    assert torch.equal(seq_c[1, 4:], alone[0])
    torch.testing.assert_close(scores_c[:, 1], scores_alone[:, 0], rtol=0, atol=1e-10)


def test_generate_exact_alibi_matches_transformers():
    model = tiny("bloom")
    x = ids(length=10)
    ref, ref_scores = _generate(model, x, True)
    with hf.use_alibi(model):
        seq, scores = _generate(model, x, True)
    assert torch.equal(seq, ref)
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Reversibility, training, loading, errors
# ------------------------------------------------------------------------------------------------


def test_restore_is_complete():
    model = tiny("mistral")
    base = model.model
    impl, window = model.config._attn_implementation, model.config.sliding_window
    n_hooks = len(base._forward_pre_hooks)
    x = ids(length=20)
    ref = logits(model, x)
    swap = hf.use_positional_lsh(model, num_samples=3)
    assert model.config._attn_implementation == hf.ATTN_IMPLEMENTATION
    assert model.config.sliding_window is None
    assert hf.current_swap(model) is swap
    top = hf.use_alibi(model)  # stacked on the first swap, which stays installed below it
    assert swap.active and hf.current_swap(model) is top
    assert hf.restore(model) is True  # the whole stack
    assert not swap.active and not top.active
    assert hf.restore(model) is False
    assert hf.current_swap(model) is None
    assert model.config._attn_implementation == impl and model.config.sliding_window == window
    assert len(base._forward_pre_hooks) == n_hooks
    assert "forward" not in base.rotary_emb.__dict__
    assert all(not hasattr(m, "_positional_lsh_swap") for m in model.modules())
    assert torch.equal(logits(model, x), ref)

    bloom = tiny("bloom")
    attn = bloom.transformer.h[0].self_attention
    with hf.use_positional_lsh(bloom):
        assert "forward" in attn.__dict__
    assert "forward" not in attn.__dict__ and bloom.config._attn_implementation == "eager"


def test_training_fresh_partitions_and_gradient_checkpointing():
    def grads(checkpointing: bool):
        model = tiny("llama")
        if checkpointing:
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.train()
        x = ids(length=24)
        with hf.use_positional_lsh(model, num_samples=4, seed=5) as swap:
            loss = model(x, labels=x, use_cache=False).loss
            loss.backward()
            step_one = swap.partitions(0, 24, training=True)
            model(x, use_cache=False)
            step_two = swap.partitions(0, 24, training=True)
            eval_parts = swap.partitions(0, 24)
            if not checkpointing:  # (checkpointing turns the cache off)
                step = swap.step
                cache = model(x[:, :20], use_cache=True).cache
                model(x[:, 20:], cache=cache, use_cache=True)  # continuing a cache keeps the step's partitions
                assert swap.step == step + 1
        return {n: p.grad.clone() for n, p in model.named_parameters()}, step_one, step_two, eval_parts

    g_plain, one, two, ev = grads(False)
    g_ckpt, *_ = grads(True)
    assert all(torch.isfinite(g).all() for g in g_plain.values())
    assert g_plain["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    for n in g_plain:  # recomputation in the backward reuses the step's partitions
        torch.testing.assert_close(g_ckpt[n], g_plain[n], rtol=1e-9, atol=1e-12)
    assert not torch.equal(one.pitch, two.pitch)  # fresh partitions each training step
    assert not torch.equal(one.pitch, ev.pitch)


def test_load_local_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny("bloom", dtype=torch.float32)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = hf.load_local_model(tmp_path / "ckpt")
    assert loaded.tokenizer is None and not loaded.model.training
    x = ids(length=16)
    torch.testing.assert_close(logits(loaded.model, x), logits(model, x))

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "ckpt")
    model2, tokenizer = hf.load_local_model(str(tmp_path / "ckpt"), dtype="float64")
    assert model2.dtype == torch.float64
    assert tokenizer("hello world")["input_ids"] == [1, 2]

    with pytest.raises(FileNotFoundError):
        hf.load_local_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        hf.load_local_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="dtype"):
        hf.load_local_model(tmp_path / "ckpt", dtype="float99")
    with pytest.raises(TypeError, match="path"):
        hf.load_local_model(3)


def test_bad_input():
    model = tiny("bloom")
    x = ids(length=10)
    ref = logits(model, x)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.use_positional_lsh(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        hf.use_alibi(AutoModelForCausalLM.from_config(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2)))
    falcon_rope = AutoModelForCausalLM.from_config(
        FalconConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, alibi=False)
    )
    with pytest.raises(ValueError, match="alibi=False"):
        hf.use_alibi(falcon_rope)
    for kwargs, err, match in [
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"num_samples": 2.5}, TypeError, "num_samples"),
        ({"scheme": "nope"}, ValueError, "scheme"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": "1"}, TypeError, "seed"),
        ({"slopes": [0.5, 0.25]}, ValueError, "slopes"),
        ({"slopes": -1.0}, ValueError, "slopes"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"backend": None}, ValueError, "backend"),
        ({"method": "fast"}, ValueError, "method"),
        ({"method": None}, ValueError, "method"),
        ({"resample_in_training": 1}, TypeError, "resample_in_training"),
    ]:
        with pytest.raises(err, match=match):
            hf.use_positional_lsh(model, **kwargs)
    with pytest.raises(ValueError, match="window"):
        hf.use_alibi(model, window=-1.0)
    for window in (None, 4.0):  # exact and windowed ALiBi have no Triton kernels: refused at swap time
        with pytest.raises(ValueError, match=r"backend='triton'.*no Triton kernels"):
            hf.use_alibi(model, window=window, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        hf.use_alibi(model, backend="cuda")
    assert hf.current_swap(model) is None and torch.equal(logits(model, x), ref)  # failed swaps change nothing

    with hf.use_positional_lsh(model, num_samples=2):
        model.transformer.h[0].self_attention.attention_dropout.p = 0.1
        model.train()
        with pytest.raises(ValueError, match="dropout"):
            model(x)

    llama = tiny("llama")
    with hf.use_alibi(llama):
        with pytest.raises(ValueError, match="4-D"):  # a custom mask (taken by the RoPE family) of the wrong shape
            logits(llama, x, attention_mask=torch.zeros(2, 1, 10, 9, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------
# Copies and stacked swaps (issue 19: #2 deepcopy, #5 nesting)
# ------------------------------------------------------------------------------------------------

ALL_FAMILIES = ["bloom", "mpt", "falcon", "falcon-gqa", "llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_deepcopy_of_a_swapped_model_is_independent(name):
    model = tiny(name)
    x = ids(length=16)
    stock = logits(model, x)
    swap = hf.use_positional_lsh(model, num_samples=3, seed=4)
    swapped = logits(model, x)
    twin = copy.deepcopy(model)
    twin_swap = hf.current_swap(twin)
    assert twin_swap is not None and twin_swap is not swap and twin_swap.model is twin
    assert torch.equal(logits(twin, x), swapped)  # the copy is swapped like the original
    twin.train()
    twin(x, use_cache=False)  # the copy's training steps advance the copy's swap only
    assert (twin_swap.step, swap.step) == (1, 0)
    twin.eval()
    assert hf.restore(twin) is True
    assert swap.active and hf.current_swap(model) is swap  # the original is untouched
    assert torch.equal(logits(model, x), swapped)
    assert torch.equal(logits(twin, x), stock)  # and the copy is back to its own attention
    assert hf.restore(model) is True and torch.equal(logits(model, x), stock)
    assert all("_positional_lsh_swap" not in m.__dict__ for m in (*model.modules(), *twin.modules()))


@pytest.mark.parametrize("name", ALL_FAMILIES)
def test_nested_swaps_restore_the_outer_one(name):
    model = tiny(name, attn_implementation="sdpa" if name.startswith("falcon") else None)
    x = ids(length=16)
    stock = logits(model, x)
    with hf.use_positional_lsh(model, num_samples=2, seed=1) as outer:
        plsh = logits(model, x)
        with hf.use_alibi(model) as inner:
            assert hf.current_swap(model) is inner
            exact = logits(model, x)
            assert not torch.allclose(exact, plsh)
        assert not inner.active and outer.active
        assert hf.current_swap(model) is outer  # the outer swap is back, with its partitions
        assert torch.equal(logits(model, x), plsh)
    assert hf.current_swap(model) is None
    assert torch.equal(logits(model, x), stock)
    # restoring a swap with another stacked on it restores that one first; restore() undoes the whole stack
    a = hf.use_alibi(model)
    b = hf.use_positional_lsh(model, num_samples=2)
    a.restore()
    assert not a.active and not b.active and hf.current_swap(model) is None
    assert torch.equal(logits(model, x), stock)
    hf.use_alibi(model)
    hf.use_positional_lsh(model, num_samples=2)
    hf.use_alibi(model, window=4.0)
    assert hf.restore(model) is True and hf.current_swap(model) is None
    assert torch.equal(logits(model, x), stock)
    assert all("_positional_lsh_swap" not in m.__dict__ for m in model.modules())


def test_huge_num_samples_refused_up_front():
    """Issue 27, item 18: use_positional_lsh(num_samples=10**8) was accepted, and a forward took 22 s before any
    refusal; now refused at once with the estimate of the draws (T per head in every layer), the model untouched."""
    from positional_lsh.ops.errors import UserError

    model = tiny("bloom")
    x = ids(length=16)
    before = logits(model, x)
    with pytest.raises(UserError, match=r"use_positional_lsh with num_samples=100000000 .*heads, \d+ layers"):
        hf.use_positional_lsh(model, num_samples=10**8)
    assert torch.equal(logits(model, x), before)
    with hf.use_positional_lsh(model, num_samples=4, seed=0):
        logits(model, x)
