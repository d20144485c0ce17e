"""Issue 34, the transformers swap as the reliability probes and transformers' own model tests used it: a swap
changes its own model only (item 9), saved swaps read from either record (10, 12), a refused call changes nothing
(11), Falcon under the registered name (13), the loader's bounds at the swap (14), messages naming the file and the
cause (17), a changed attention implementation (20), meta initialization (21) and a croppable ``LiveKeyCache`` (22).
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

from hf_tiny import tiny_config, tiny_model, token_ids
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from positional_lsh.integrations import hf
from positional_lsh.integrations.hf.saved import CONFIG_KEY, MAX_NUM_SAMPLES, MAX_SEED, SWAP_FILE
from positional_lsh.ops.errors import UserError


def _from_config(config, seed: int = 0, **kwargs):
    """``AutoModelForCausalLM.from_config(config)``: the model holds ``config`` itself (transformers shares it)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


def _logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids() if ids is None else ids).logits


# ---------------------------------------------------------------------------------------------------------------------
# Item 9: a swap changes its own model only
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mistral", "bloom", "falcon"])
def test_swapping_one_model_leaves_another_on_the_same_config_alone(name):
    config = tiny_config(name)
    a, b = _from_config(config), _from_config(config, seed=1)
    assert a.config is b.config is config  # (what transformers does: the premise of the item)
    before = _logits(b)
    hf.use_positional_lsh(a, num_samples=4, seed=0)
    assert hf.current_swap(b) is None
    assert torch.equal(_logits(b), before)
    assert config._attn_implementation == b.config._attn_implementation
    if name == "mistral":
        assert config.sliding_window == 8
    # a model built from the config afterwards is a stock model (Falcon's constructor used to raise KeyError)
    c = _from_config(config, seed=1)
    assert torch.equal(_logits(c), before)
    hf.restore(a)
    assert torch.equal(_logits(b), before)


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_restoring_one_of_two_swapped_models_leaves_the_other_swapped(name):
    config = tiny_config(name)
    a, b = _from_config(config), _from_config(config, seed=1)
    hf.use_alibi(a, window=3.0)
    swap_b = hf.use_alibi(b, window=3.0)
    swapped = _logits(b)
    hf.restore(a)
    assert hf.current_swap(b) is swap_b
    assert torch.equal(_logits(b), swapped)
    swap_b.restore()
    stock = _logits(_from_config(config, seed=1))
    assert torch.equal(_logits(b), stock)


@pytest.mark.parametrize("name", ["qwen3", "bloom"])
def test_two_models_from_one_saved_config_each_get_their_own_swap(tmp_path, name):
    model = tiny_model(name)
    hf.use_positional_lsh(model, num_samples=4, seed=3, slopes=0.2)
    model.save_pretrained(tmp_path)
    weights = model.state_dict()
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    a = _from_config(config, attn_implementation="positional_lsh")
    b = _from_config(config, attn_implementation="positional_lsh")
    a.load_state_dict(weights)
    b.load_state_dict(weights)
    expected = _logits(model)
    assert torch.equal(_logits(a), expected)  # a's first call installs a's swap, not b's
    assert hf.current_swap(a) is not None and hf.current_swap(b) is None
    assert torch.equal(_logits(b), expected)
    assert hf.current_swap(b) is not hf.current_swap(a)
    hf.restore(a)  # the model's own attention, b untouched
    assert torch.equal(_logits(b), expected)
    hf.restore(model)
    assert torch.equal(_logits(a), _logits(model))


# ---------------------------------------------------------------------------------------------------------------------
# Items 10, 12: a saved swap is read from config.json too; restoring then saving leaves no stale swap file
# ---------------------------------------------------------------------------------------------------------------------


def test_a_swap_recorded_only_in_config_json_is_loaded(tmp_path):
    model = tiny_model("qwen3")
    hf.use_positional_lsh(model, num_samples=4, seed=3, slopes=0.2)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    (tmp_path / SWAP_FILE).unlink()  # as a model loaded with the registered name and saved before its first call
    assert CONFIG_KEY in json.loads((tmp_path / "config.json").read_text())
    loaded = hf.load_local_model(tmp_path, quiet=True).model
    assert hf.current_swap(loaded) is not None
    assert torch.equal(_logits(loaded), expected)
    # and a model built with the registered name, saved before its first call, writes such a folder
    again = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="positional_lsh").eval()
    again.save_pretrained(tmp_path / "again")
    assert torch.equal(_logits(hf.load_local_model(tmp_path / "again", quiet=True).model), expected)


@pytest.mark.parametrize("name", ["qwen3", "bloom"])
def test_restore_then_save_into_the_same_folder_leaves_no_stale_swap(tmp_path, name):
    model = tiny_model(name)
    hf.use_positional_lsh(model, num_samples=4, seed=3)
    model.save_pretrained(tmp_path)
    assert (tmp_path / SWAP_FILE).is_file()
    hf.restore(model)
    stock = _logits(model)
    model.save_pretrained(tmp_path)
    assert not (tmp_path / SWAP_FILE).exists()
    assert CONFIG_KEY not in json.loads((tmp_path / "config.json").read_text())
    loaded = hf.load_local_model(tmp_path, quiet=True).model
    assert hf.current_swap(loaded) is None
    assert torch.equal(_logits(loaded), stock)


# ---------------------------------------------------------------------------------------------------------------------
# Item 11: a refused call changes nothing
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("live", [True, False])
def test_a_refused_call_leaves_the_cache_as_it_was(live):
    model = tiny_model("llama")
    swap = hf.use_alibi(model)
    ids = token_ids(batch=1, length=12)
    cache = swap.new_cache() if live else DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        lengths = [layer.keys.shape[-2] for layer in cache.layers]
        seen = cache.get_seq_length()
        four_d = torch.ones(1, 1, 1, 13, dtype=torch.bool)  # (a mask with holes is taken since item 24: a 4-D one)
        with pytest.raises(ValueError, match="custom 4-D attention_mask cannot continue a KV cache"):
            model(token_ids(batch=1, length=1, seed=5), attention_mask=four_d, past_key_values=cache, use_cache=True)
        assert [layer.keys.shape[-2] for layer in cache.layers] == lengths
        assert cache.get_seq_length() == seen
        nxt = token_ids(batch=1, length=1, seed=5)
        out = model(nxt, past_key_values=cache, use_cache=True).logits
        full = model(torch.cat([ids, nxt], dim=1)).logits[:, -1:]
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Item 13: Falcon with the registered name
# ---------------------------------------------------------------------------------------------------------------------


def test_falcon_loads_with_the_registered_name(tmp_path):
    model = tiny_model("falcon")
    hf.use_positional_lsh(model, num_samples=4, seed=3)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="positional_lsh").eval()
    assert torch.equal(_logits(loaded), expected)
    config = AutoConfig.from_pretrained(tmp_path)
    built = _from_config(config, attn_implementation="positional_lsh")
    built.load_state_dict(model.state_dict())
    assert torch.equal(_logits(built), expected)


# ---------------------------------------------------------------------------------------------------------------------
# Item 14: the swap refuses what the loader refuses
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("seed", MAX_SEED + 1), ("seed", 10**30),
                                              ("num_samples", MAX_NUM_SAMPLES + 1)])  # fmt: skip
def test_the_swap_refuses_settings_the_loader_would_refuse(field, value):
    model = tiny_model("bloom", layers=1, heads=1, hidden=8)
    kwargs = {"num_samples": 2, "seed": 0, field: value}
    with pytest.raises(ValueError, match=rf"{field} must be .*{MAX_SEED if field == 'seed' else MAX_NUM_SAMPLES}"):
        hf.use_positional_lsh(model, **kwargs)
    assert hf.current_swap(model) is None


def test_the_largest_seed_saves_and_loads(tmp_path):
    model = tiny_model("bloom")
    hf.use_positional_lsh(model, num_samples=2, seed=MAX_SEED)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    assert torch.equal(_logits(hf.load_local_model(tmp_path, quiet=True).model), expected)


# ---------------------------------------------------------------------------------------------------------------------
# Item 17: messages name the file and the cause
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("slopes", "match"), [([float("inf")], "'slopes' must hold finite numbers"),
                                               ([0.1, 0.2, 0.3], "one entry per head")])  # fmt: skip
@pytest.mark.parametrize("where", ["file", "config"])
def test_bad_saved_slopes_are_refused_naming_their_file(tmp_path, slopes, match, where):
    model = tiny_model("bloom")
    hf.use_alibi(model)
    model.save_pretrained(tmp_path)
    file = tmp_path / (SWAP_FILE if where == "file" else "config.json")
    record = json.loads(file.read_text())
    (record if where == "file" else record[CONFIG_KEY])["slopes"] = slopes
    file.write_text(json.dumps(record))
    if where == "config":
        (tmp_path / SWAP_FILE).unlink()
    name = SWAP_FILE if where == "file" else "config.json"
    with pytest.raises(UserError, match=rf"{name}.*{match}"):
        hf.load_local_model(tmp_path, quiet=True)
    if where == "config":  # (the registered name reads config.json first)
        with pytest.raises(UserError, match=rf"{name}.*{match}"):
            AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="positional_lsh")(token_ids())


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_model_compiled_before_its_first_call_gets_its_saved_swap(tmp_path, fullgraph):
    model = tiny_model("qwen3")
    hf.use_positional_lsh(model, num_samples=4, seed=3)
    expected = _logits(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="positional_lsh").eval()
    compiled = torch.compile(loaded, backend="eager", fullgraph=fullgraph)  # installed outside the graph
    assert torch.equal(_logits(compiled), expected)
    assert hf.current_swap(loaded) is not None


def test_the_registered_name_without_a_swap_names_the_remedies():
    from positional_lsh.integrations.hf.forward import swap_of

    model = _from_config(tiny_config("qwen3"), attn_implementation="positional_lsh")
    attn = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    with pytest.raises(RuntimeError, match=r"install a swap.*first call.*load_local_model.*apply_saved_swap"):
        swap_of(attn)


# ---------------------------------------------------------------------------------------------------------------------
# Item 20: a changed attention implementation does not bypass the swap
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("how", ["set_attn_implementation", "config"])
def test_a_changed_attention_implementation_keeps_the_swap_in_force(name, how):
    model = tiny_model(name)
    swap = hf.use_positional_lsh(model, num_samples=4, seed=0)
    swapped = _logits(model)
    with pytest.warns(UserWarning, match="stays in force"):
        if how == "config":
            model.config._attn_implementation = "eager"
        else:
            model.set_attn_implementation("eager")
        assert torch.equal(_logits(model), swapped)
    assert hf.current_swap(model) is swap
    swap.restore()
    assert torch.equal(_logits(model), _logits(tiny_model(name)))


# ---------------------------------------------------------------------------------------------------------------------
# Item 21: a swap made on the meta device
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bloom", "llama"])
@pytest.mark.parametrize("mode", ["alibi", "plsh"])
def test_a_swap_made_on_the_meta_device_runs_after_to_empty(name, mode):
    reference = tiny_model(name)
    with torch.device("meta"):
        model = _from_config(copy.deepcopy(tiny_config(name)))
        swap = hf.use_alibi(model) if mode == "alibi" else hf.use_positional_lsh(model, num_samples=4, seed=0)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    assert swap.slopes.device.type == "cpu"
    if mode == "alibi":
        hf.use_alibi(reference)
    else:
        hf.use_positional_lsh(reference, num_samples=4, seed=0)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Item 22: LiveKeyCache is croppable while it holds every key
# ---------------------------------------------------------------------------------------------------------------------


def test_assisted_decoding_with_a_live_key_cache_of_exact_alibi():
    model = tiny_model("bloom")
    swap = hf.use_alibi(model)
    assistant = tiny_model("bloom", seed=1)
    hf.use_alibi(assistant)
    ids = token_ids(batch=1, length=10)
    cache = swap.new_cache()
    assert cache.is_croppable
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assisted = model.generate(ids, assistant_model=assistant, past_key_values=cache, **kw)
        plain = model.generate(ids, **kw)
    assert torch.equal(assisted, plain)


def test_a_live_key_cache_that_dropped_keys_is_not_croppable():
    model = tiny_model("bloom")
    swap = hf.use_alibi(model, window=2.0)
    cache = swap.new_cache()
    with torch.no_grad():
        model(token_ids(batch=1, length=6), past_key_values=cache, use_cache=True)
        model(token_ids(batch=1, length=1), past_key_values=cache, use_cache=True)
    assert min(layer.offset for layer in cache.layers) > 0
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot be cropped after it dropped"):
        cache.crop(-1)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon"])
def test_a_changed_attention_implementation_keeps_a_native_swap_in_force(name):
    """The native families (found by transformers' assisted-decoding tests, which set ``config._attn_implementation
    = "eager"`` on the model; their ``set_attn_implementation`` changes nothing): the name selected transformers'
    eager 4-D mask, which the swap's forward refused ("unsupported attention mask (1, 1, 7, 7)"). It is put back at
    the next call, with a warning, as for the RoPE family: a padded batch gives the swapped model's logits."""
    model = tiny_model(name)
    swap = hf.use_alibi(model)
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        swapped = model(ids, attention_mask=mask).logits
    with pytest.warns(UserWarning, match="stays in force"):
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            assert torch.equal(model(ids, attention_mask=mask).logits, swapped)
    assert model.config._attn_implementation == "positional_lsh"
    assert hf.current_swap(model) is swap
