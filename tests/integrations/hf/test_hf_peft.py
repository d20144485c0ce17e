"""peft models and saved swap settings (issue 18 B and D): tiny random models, nothing downloaded."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf import ids, logits, tiny  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.ops.errors import UserError  # noqa: E402


def ours(capsys) -> list[str]:
    """This library's lines on stderr (transformers prints progress bars there too)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("positional_lsh")]


def lora(model, r: int = 4):
    cfg = peft.LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def test_peft_model_is_accepted_and_restored():
    base = tiny("llama")
    x = ids(length=16)
    pm = lora(base)
    stock = logits(pm, x)
    with torch.no_grad():
        ref_swap = hf.use_positional_lsh(base, num_samples=3, seed=2)  # the same swap on the base model directly
        expected = logits(pm, x)
        ref_swap.restore()
    assert torch.equal(logits(pm, x), stock)
    swap = hf.use_positional_lsh(pm, num_samples=3, seed=2)
    assert swap.model is base and hf.current_swap(pm) is swap and hf.current_swap(base) is swap
    assert hf.model_family(pm) == "rope"
    assert torch.equal(logits(pm, x), expected)  # LoRA deltas + positional LSH
    pm.train()
    pm(x, labels=x, use_cache=False).loss.backward()  # trains the adapter through the swap
    assert swap.step == 1
    grads = [p.grad for n, p in pm.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)  # the base stays frozen
    pm.eval()
    assert hf.restore(pm) is True and hf.current_swap(pm) is None and hf.current_swap(base) is None
    assert torch.equal(logits(pm, x), stock)
    with hf.use_alibi(pm):
        alibi = logits(pm, x)
    assert not torch.allclose(alibi, stock)


def test_merged_peft_model_keeps_the_swap_and_restores():
    base = tiny("bloom")
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["query_key_value"], init_lora_weights=False))
    x = ids(length=16)
    swap = hf.use_positional_lsh(pm, num_samples=3, seed=1)
    before = logits(pm, x)
    merged = pm.merge_and_unload()
    assert hf.current_swap(merged) is swap
    torch.testing.assert_close(logits(merged, x), before, rtol=1e-10, atol=1e-10)
    stock_merged = None
    assert hf.restore(merged) is True
    stock_merged = logits(merged, x)
    with hf.use_positional_lsh(merged, num_samples=3, seed=1):
        torch.testing.assert_close(logits(merged, x), before, rtol=1e-10, atol=1e-10)
    assert torch.equal(logits(merged, x), stock_merged)


def test_wrappers_other_than_peft_are_refused_with_a_hint():
    model = tiny("bloom")
    ddp_like = torch.nn.Module()
    ddp_like.module = model
    with pytest.raises(TypeError, match=r"PeftModel.*\.module"):
        hf.use_positional_lsh(ddp_like)


# ------------------------------------------------------------------------------------------------
# Saved settings
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mistral", "bloom"])
def test_save_pretrained_writes_the_swap_and_load_local_model_reapplies_it(tmp_path, capsys, name):
    model = tiny(name, dtype=torch.float32)
    window = model.config.sliding_window if name == "mistral" else None
    x = ids(length=24)
    swap = hf.use_positional_lsh(model, num_samples=5, scheme="gamma", seed=7, slopes=1 / 256)
    model.train()
    for _ in range(3):
        model(x, use_cache=False)
    model.eval()
    assert swap.step == 3
    want = logits(model, x)
    model.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / hf.SWAP_FILE).read_text())
    assert saved["position"] == "plsh" and saved["num_samples"] == 5 and saved["scheme"] == "gamma"
    assert saved["seed"] == 7 and saved["step"] == 3 and saved["slopes"] == [1 / 256] * 4
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config.get("sliding_window") == window  # saved as before the swap (Mistral: not null)
    assert getattr(model.config, "sliding_window", None) is None  # and still swapped
    # a plain from_pretrained stays what transformers does ...
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    assert hf.current_swap(plain) is None
    assert not torch.allclose(logits(plain, x), want)
    # ... hf.apply_saved_swap gets the swap back, and load_local_model re-applies it and says so in one line
    again = hf.apply_saved_swap(plain, tmp_path / "ckpt")
    assert again is not None and again.step == 3
    torch.testing.assert_close(logits(plain, x), want)
    capsys.readouterr()
    loaded, _ = hf.load_local_model(tmp_path / "ckpt")
    err = ours(capsys)
    assert len(err) == 1 and "re-applied" in err[0] and "plsh T=5 gamma" in err[0] and "sigma 256" in err[0]
    assert "training step 3" in err[0]
    s = hf.current_swap(loaded)
    assert s.num_samples == 5 and s.seed == 7 and s.step == 3 and torch.equal(s.slopes, swap.slopes)
    torch.testing.assert_close(logits(loaded, x), want)
    loaded.train()
    loaded(x, use_cache=False)
    model.train()
    model(x, use_cache=False)
    assert torch.equal(s.partitions(0, 24, training=True).pitch, swap.partitions(0, 24, training=True).pitch)
    stock, _ = hf.load_local_model(tmp_path / "ckpt", apply_swap=False)
    assert hf.current_swap(stock) is None and ours(capsys) == []


def test_saved_alibi_and_window_and_peft_adapter(tmp_path, capsys):
    base = tiny("llama", dtype=torch.float32)
    x = ids(length=20)
    base.save_pretrained(tmp_path / "base")
    with hf.use_alibi(base, window=6.0, slopes=[0.5, 0.25, 0.125, 0.0625]):
        want = logits(base, x)
        base.save_pretrained(tmp_path / "win")
    loaded, _ = hf.load_local_model(tmp_path / "win", quiet=True)
    assert ours(capsys) == []
    s = hf.current_swap(loaded)
    assert s.mode == "alibi" and s.window.tolist() == [6.0] * 4
    torch.testing.assert_close(logits(loaded, x), want)

    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    pm = lora(fresh)
    swap = hf.use_positional_lsh(pm, num_samples=4, seed=3)
    pm.eval()
    want = logits(pm, x)
    pm.save_pretrained(tmp_path / "adapter")  # the adapter, and the swap next to it
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "adapter" / hf.SWAP_FILE).read_text())["num_samples"] == 4
    merged, _ = hf.load_local_model(tmp_path / "adapter")
    assert "re-applied" in ours(capsys)[0]
    assert not isinstance(merged, peft.PeftModel) and hf.current_swap(merged).seed == swap.seed
    torch.testing.assert_close(logits(merged, x), want, rtol=1e-5, atol=1e-5)
    unmerged, _ = hf.load_local_model(tmp_path / "adapter", merge_adapter=False, quiet=True)
    assert isinstance(unmerged, peft.PeftModel)
    torch.testing.assert_close(logits(unmerged, x), want, rtol=1e-5, atol=1e-5)


def test_bad_saved_settings_are_refused_naming_the_file(tmp_path):
    model = tiny("bloom", dtype=torch.float32)
    with hf.use_positional_lsh(model, num_samples=2):
        model.save_pretrained(tmp_path / "c")
    file = tmp_path / "c" / hf.SWAP_FILE
    good = json.loads(file.read_text())
    for change, match in [({"position": "rope"}, "position"), ({"num_samples": 0}, "num_samples"),
                          ({"slopes": []}, "slopes"), ({"step": -1}, "step"), ({"format": "x"}, "format|not a"),
                          ({"version": 9}, "version")]:  # fmt: skip
        file.write_text(json.dumps({**good, **change}))
        with pytest.raises(UserError, match=match) as info:
            hf.load_local_model(tmp_path / "c")
        assert str(file) in str(info.value)
    file.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        hf.load_local_model(tmp_path / "c")
    file.write_text(json.dumps({**good, "slopes": [0.5, 0.25]}))  # wrong number of heads
    with pytest.raises(ValueError, match="slopes"):
        hf.load_local_model(tmp_path / "c")
