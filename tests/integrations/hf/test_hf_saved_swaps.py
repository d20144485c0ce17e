"""Issue 27, the transformers swap: ``attn_implementation="positional_lsh"`` on its own (item 3), a reused
``LiveKeyCache`` (item 12), saved settings applied to the wrong model (item 13), absurd values in a swap file
(item 17) and a bogus scheme named with its file (item 26)."""

from __future__ import annotations

import copy
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

from hf_tiny import tiny_model, token_ids
from transformers import AutoConfig, AutoModelForCausalLM

from positional_lsh.integrations import hf
from positional_lsh.integrations.hf.saved import SWAP_FILE
from positional_lsh.ops.errors import UserError

CONFIG_KEY = "positional_lsh_swap"  # (saved.CONFIG_KEY)


def _saved(tmp_path: Path, name: str, mode: str = "plsh", folder: str = "ckpt") -> tuple[Path, torch.Tensor]:
    """A swapped tiny model saved in ``tmp_path / folder``, and its logits on ``token_ids()``."""
    model = tiny_model(name)
    if mode == "plsh":
        hf.use_positional_lsh(model, num_samples=4, seed=3, slopes=0.2)
    else:
        hf.use_alibi(model, window=5.0)
    with torch.no_grad():
        logits = model(token_ids()).logits
    path = tmp_path / folder
    model.save_pretrained(path)
    return path, logits


def _load(path: Path, **kwargs: object) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs).eval()


# ---------------------------------------------------------------------------------------------------------------------
# Item 3: the registered name alone reproduces the saved model
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "mode"), [("qwen3", "plsh"), ("llama", "window"), ("bloom", "plsh"),
                                            ("bloom", "window")])  # fmt: skip
def test_from_pretrained_with_the_registered_name_gives_the_saved_model(tmp_path, name, mode):
    path, logits = _saved(tmp_path, name, mode)
    assert CONFIG_KEY in json.loads((path / "config.json").read_text())  # config.json describes the swap
    model = _load(path, attn_implementation="positional_lsh")
    with torch.no_grad():
        out = model(token_ids()).logits
    assert torch.equal(out, logits)
    swap = hf.current_swap(model)
    assert swap is not None and swap.mode == ("plsh" if mode == "plsh" else "alibi")
    if mode == "plsh":
        assert (swap.num_samples, swap.seed) == (4, 3)
    # and restoring gives the model's own attention back
    hf.restore(model)
    with torch.no_grad():
        assert not torch.equal(model(token_ids()).logits, logits)


@pytest.mark.parametrize("name", ["qwen3", "bloom"])
def test_a_copy_made_before_the_first_call_is_the_saved_model_too(tmp_path, name):
    path, logits = _saved(tmp_path, name)
    model = _load(path, attn_implementation="positional_lsh")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(token_ids()).logits, logits)
        assert torch.equal(model(token_ids()).logits, logits)
    assert hf.current_swap(twin) is not hf.current_swap(model)


@pytest.mark.parametrize("name", ["qwen3", "bloom"])
def test_from_config_and_the_swap_file_alone(tmp_path, name):
    path, logits = _saved(tmp_path, name)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="positional_lsh")
    model.load_state_dict(_load(path, attn_implementation="eager").state_dict())
    with torch.no_grad():
        assert torch.equal(model.eval()(token_ids()).logits, logits)
    # a checkpoint whose config.json lacks the key (written before it existed): the folder's swap file is read
    cfg = json.loads((path / "config.json").read_text())
    del cfg[CONFIG_KEY]
    (path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        assert torch.equal(_load(path, attn_implementation="positional_lsh")(token_ids()).logits, logits)


def test_the_registered_name_without_settings_says_what_to_do():
    config = tiny_model("qwen3").config
    model = AutoModelForCausalLM.from_config(config, attn_implementation="positional_lsh").eval()
    for _ in range(2):  # refused at every call, not only the first
        with pytest.raises(UserError, match=r"needs the swap's settings.*use_positional_lsh"):
            model(token_ids())
    hf.use_positional_lsh(model, num_samples=2)  # a swap installed by hand is used as before
    with torch.no_grad():
        model(token_ids())


def test_a_plain_load_of_a_swapped_checkpoint_warns_once(tmp_path):
    path, logits = _saved(tmp_path, "qwen3")
    warned = r"config\.json holds a positional-LSH swap.*attn_implementation='positional_lsh'"
    with pytest.warns(UserWarning, match=warned):
        plain = _load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(path)  # once per checkpoint
        loaded, _ = hf.load_local_model(path, quiet=True)  # the loader applies the swap itself: no warning
    with torch.no_grad():
        assert not torch.equal(plain(token_ids()).logits, logits)  # (the model's own attention, as warned)
        assert torch.equal(loaded(token_ids()).logits, logits)


def test_the_saved_config_is_as_before_the_swap_and_the_live_one_untouched(tmp_path):
    path, _ = _saved(tmp_path, "mistral")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["sliding_window"] == 8 and cfg[CONFIG_KEY]["family"] == "rope"
    assert cfg[CONFIG_KEY] == json.loads((path / SWAP_FILE).read_text())


# ---------------------------------------------------------------------------------------------------------------------
# Item 12: a LiveKeyCache reused by a second generate()
# ---------------------------------------------------------------------------------------------------------------------


def test_a_reused_live_key_cache_continues_or_is_refused():
    model = tiny_model("qwen3", dtype=torch.float64)
    swap = hf.use_positional_lsh(model, num_samples=4, seed=1, slopes=0.3)
    x = token_ids(batch=1, length=40)

    def gen(ids, cache):
        return model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, cache=cache)

    cache = swap.new_cache()
    first = gen(x, cache)
    assert torch.equal(first, gen(x, None))
    # continuing the cached sequence (what transformers' DynamicCache supports) equals a fresh cache
    assert torch.equal(gen(first, cache), gen(first, swap.new_cache()))
    # the same prompt again with the used cache would read another sequence's keys: refused in one line
    with pytest.raises(ValueError, match=r"LiveKeyCache holds a sequence of .* swap\.new_cache"):
        gen(x, cache)
    with pytest.raises(ValueError, match="does not continue the cached sequence"):
        gen(x, cache)  # (and not only once)
    assert torch.equal(gen(x, swap.new_cache()), first)


# ---------------------------------------------------------------------------------------------------------------------
# Items 13, 17, 26: the swap file checked, naming the file
# ---------------------------------------------------------------------------------------------------------------------


def test_a_swap_file_of_another_family_is_refused(tmp_path):
    bloom, _ = _saved(tmp_path, "bloom", folder="bloom")
    falcon, _ = _saved(tmp_path, "falcon", mode="window", folder="falcon")
    shutil.copy(falcon / SWAP_FILE, bloom / SWAP_FILE)
    pattern = rf"{SWAP_FILE} records a swap for a 'falcon' model, but this model is 'bloom'"
    with pytest.raises(UserError, match=pattern):
        hf.load_local_model(bloom, quiet=True)
    plain = _load(bloom, attn_implementation="eager")
    with pytest.raises(UserError, match=pattern):
        hf.apply_saved_swap(plain, bloom)
    assert hf.current_swap(plain) is None
    with pytest.raises(UserError, match="saved for a 'falcon' model, but this model is 'bloom'"):
        hf.apply_swap_settings(plain, hf.read_swap_settings(bloom))


def test_a_swap_file_that_is_a_directory_is_refused(tmp_path):
    path, _ = _saved(tmp_path, "bloom")
    (path / SWAP_FILE).unlink()
    (path / SWAP_FILE).mkdir()
    with pytest.raises(UserError, match=rf"{SWAP_FILE} is not a file"):
        hf.read_swap_settings(path)
    with pytest.raises(UserError, match=rf"{SWAP_FILE} is not a file"):
        hf.load_local_model(path, quiet=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_samples", 10**9), ("num_samples", 10**30), ("step", 2**63), ("seed", 2**64), ("seed", 10**30)],
)
def test_absurd_values_in_a_swap_file_are_refused_in_one_line(tmp_path, field, value):
    path, _ = _saved(tmp_path, "bloom")
    settings = json.loads((path / SWAP_FILE).read_text())
    settings[field] = value
    (path / SWAP_FILE).write_text(json.dumps(settings))
    with pytest.raises(UserError, match=rf"{SWAP_FILE}: '{field}' must be an integer in") as info:
        hf.load_local_model(path, quiet=True)
    assert "\n" not in str(info.value)


def test_a_bogus_scheme_names_the_file(tmp_path):
    path, _ = _saved(tmp_path, "bloom")
    settings = json.loads((path / SWAP_FILE).read_text())
    settings["scheme"] = "bogus"
    (path / SWAP_FILE).write_text(json.dumps(settings))
    with pytest.raises(UserError, match=rf"{SWAP_FILE}: 'scheme' must be one of .*'discrete'.* got 'bogus'"):
        hf.read_swap_settings(path)
