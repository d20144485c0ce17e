"""transformers' own model tests, run on swapped models: a sweep over families x swaps (issue 34).

Developer tooling, not part of the package (nor the wheel). It runs transformers' common model tests
(``tests/test_modeling_common.py``'s ``ModelTesterMixin``, the file of the installed transformers version) on
BLOOM, Falcon (``alibi=True``), MPT, Llama and Qwen3, with every model the tests build swapped:

* ``stock``: no swap (the baseline: a test that fails here fails for reasons of its own);
* ``plsh``: ``hf.use_positional_lsh(model, num_samples=T)`` (``T = 2``);
* ``alibi``: ``hf.use_alibi(model)`` (exact ALiBi);
* ``window``: ``hf.use_alibi(model, window=3)`` (windowed ALiBi).

The swap is installed by a pytest plugin written into the scratch folder: each model class of the family's
modeling module gets an ``__init__`` that, once the outermost model is built, applies the swap (models built by
``from_pretrained``, ``from_config``, ``_from_config`` and by hand alike); a model that already carries a swap (a
loaded checkpoint whose saved swap was re-applied) is left alone.

transformers ships ``tests/test_modeling_common.py`` in its source distribution but not the per-model test files,
``tests/generation/test_utils.py`` or ``tests/exporters/test_export.py``. Give them with ``--tests`` (a
``tests/`` folder of the installed version's sources) and they are used as they are. What is missing is replaced
by stand-ins written here, named as such in the table:

* the family's tester (``models/<family>/test_modeling_<family>.py``): a config of transformers' test sizes
  (vocab 99, hidden 32, 2 layers, 4 heads, batch 13, length 7) and transformers' testers' masks (random masks
  with holes for BLOOM, Falcon and MPT, ``tril`` masks for the Llama family); every model class of the family;
* ``GenerationTesterMixin``: a few generation checks of this script's own (cache against no cache, assisted and
  prompt-lookup decoding against greedy, the static cache against the dynamic one, left padding, beam search and
  sampling running);
* ``ExportTesterMixin``: empty (the ``torch.export`` tests are not run).

``--real-tests DIR`` takes files of the public git repository (a folder laid out like ``tests/``: per-model test
files, ``generation/test_utils.py``, helpers such as ``causal_lm_tester.py`` or ``utils/test_configuration_utils.py``)
and copies them over the installed version's, in place of the stand-ins. They may come from another commit than the
installed version: the few names they import that the installed version dropped are shimmed (``BloomTokenizerFast``
and ``LlamaTokenizerFast`` as ``PreTrainedTokenizerFast``, used by slow tests only; ``require_torch_sdpa`` and
``require_read_token`` leave their test as it is; ``is_ipex_available`` is ``False``; ``StaticCache``'s
``get_max_cache_shape`` is the installed ``get_max_length``; ``generate(cache_implementation="dynamic_full")``, which
the assisted-decoding tests ask for, is the installed version's ``"dynamic"``), ``test_pipeline_mixin.py``, which
needs the repository's layout, is replaced by an empty ``PipelineTesterMixin`` (no pipeline tests), and the
distributed mixins of ``causal_lm_tester.py`` (``TensorParallelTesterMixin``, ``FSDPTesterMixin``: several processes)
by empty ones. transformers' Falcon tester builds rotary Falcons (``alibi=False``), which the swap refuses: under
``--real-tests`` every ``FalconConfig`` defaults to ``alibi=True``, in the stock runs too.

Usage (slow tests are skipped as transformers does by default; one pytest process per family and swap, ``-n 0``)::

    pip download transformers==<installed> --no-deps --no-binary :all:   # then unpack it
    python scripts/hf_model_tests.py --tests <unpacked>/tests --work /tmp/hft/run --markdown table.md
    python scripts/hf_model_tests.py --tests <unpacked>/tests --real-tests <repo files>/tests --work /tmp/hft/real \
        --families bloom llama

Each failure is classified: ``fails on stock too`` (the same test fails without a swap), ``compares against stock
numbers`` (the table ``STOCK_COMPARISONS`` below), ``checks the implementation name`` (``BY_DESIGN``: the configured
attention implementation, which a swapped model reports as the one that runs), the swap's refusal of masks with
holes or packed sequences (``MASK_REFUSALS``, messages of the code before issue 34 items 24 and 25), the swap's
documented refusal of attention dropout in training mode (``DROPOUT_REFUSAL``: transformers' own testers set an
attention dropout of 0.1), another documented limitation (``DOCUMENTED``: tests of the generation file that expect
every key in a bounded swap's caches, or no recompile of a compiled static-cache generate; ``CUSTOM_MASK_REFUSAL``:
custom 4-D masks), or ``other``, printed with its first error line. A test with subtests counts as failed
when any subtest failed, even if others were skipped. ``--from-xml`` tabulates the junit files of earlier runs. The
result and its triage: docs/reliability.md, "transformers' own model tests on swapped models: the sweep".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("bloom", "falcon", "mpt", "llama", "qwen3")
SWAPS = ("stock", "plsh", "alibi", "window")

# Tests whose failure on a swapped model is expected: they compare the swapped model's numbers with the stock
# model's (or with the attention implementation the swap replaces). Keyed by the test's name (without the
# parameterization suffix); the value says which comparison.
STOCK_COMPARISONS: dict[str, str] = {
    "test_model_rope_scaling_from_config": "RoPE scaling changes nothing once the rotary embedding is neutralized",
    "test_model_rope_scaling_frequencies": "compares the rotary embedding's numbers, which the swap neutralizes",
    "test_model_rope_with_partial_rotation": "compares the rotary embedding's numbers, which the swap neutralizes",
}

# Tests whose failure on a swapped model is by design: they check that the model's configured attention
# implementation is the one they asked for ("sdpa", "eager"), while the swap's model reports the implementation that
# runs, "positional_lsh" (transformers dispatches the Llama family's attention by that name; a changed name is put
# back at the next call with a warning, issue 34 item 20). Keyed like STOCK_COMPARISONS.
BY_DESIGN: dict[str, str] = {
    "test_sdpa_can_dispatch_non_composite_models": "expects config._attn_implementation == 'sdpa' after loading",
    "test_can_set_attention_dynamically": "expects config._attn_implementation == 'eager' right after building",
}

# Tests of transformers' generation file (``--real-tests``) whose failure on a swapped model is a documented
# limitation of the swap (docs/hf.md), keyed like STOCK_COMPARISONS: a bounded swap's caches hold the live keys only,
# and a compiled static-cache generate recompiles.
DOCUMENTED: dict[str, str] = {
    "test_generate_with_static_cache": "expects the static cache to hold max_cache_len keys: a bounded swap's holds "
    "its reach + 16 (docs/hf.md, 'Static cache and a compiled generate')",
    "test_greedy_generate_dict_outputs_use_cache": "expects a decoding step's attention weights over every key: a "
    "LiveKeyCache holds (and weighs) the live keys only (docs/hf.md, 'Attention weights')",
    "test_beam_search_generate_dict_outputs_use_cache": "the same, with beam search",
    "test_generate_compilation_all_outputs": "expects a static cache's attention weights over its max_cache_len "
    "slots: the swap's static cache's span the sequence (get_max_length() -1; docs/hf.md, 'Attention weights')",
    "test_generate_compile_model_forward_fullgraph": "expects no recompile of the compiled forward: the swap's static "
    "cache returns its filled part, which grows (docs/hf.md, 'Static cache and a compiled generate')",
}

# A failure whose message holds this is the swap's documented refusal of custom 4-D masks (docs/hf.md, "Limitations":
# "unsupported attention mask (1, 1, 6, 6): ... 4-D and custom masks are not supported", cut at 200 characters).
CUSTOM_MASK_REFUSAL = "unsupported attention mask ("

# The swap's refusals of masks with holes and packed sequences (issue 34, items 24 and 25, being implemented):
# a failure whose message holds one of these is counted apart.
MASK_REFUSALS = ("padding between valid keys", "packed sequences")

# The swap's documented refusal of attention dropout in training mode (docs/hf.md, "Limitations"): transformers'
# per-model testers (``--real-tests``) configure an attention dropout of 0.1 and train; counted apart.
DROPOUT_REFUSAL = "attention dropout (p="

# -------------------------------------------------------------------------------------------------
# Files written into the scratch folder
# -------------------------------------------------------------------------------------------------

CONFTEST = '''\
"""Swap every model the tests build (hf_model_tests.py writes this file)."""
import functools
import importlib
import os
import threading

from transformers import PreTrainedModel

from positional_lsh.integrations import hf

SWAP = os.environ["PLSH_SWEEP_SWAP"]
FAMILY = os.environ["PLSH_SWEEP_FAMILY"]
_DEPTH = threading.local()


def _apply(model):
    if SWAP == "stock" or hf.current_swap(model) is not None:
        return
    if SWAP == "plsh":
        hf.use_positional_lsh(model, num_samples=2, seed=0)
    elif SWAP == "alibi":
        hf.use_alibi(model)
    elif SWAP == "window":
        hf.use_alibi(model, window=3.0)
    else:
        raise ValueError(f"unknown swap {SWAP!r}")


def _wrap(cls):
    init = cls.__init__  # its own or inherited (the Llama family's heads inherit transformers' generic ones)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _DEPTH.n = depth
        if depth == 0:
            _apply(self)

    cls.__init__ = __init__


if os.environ.get("PLSH_SWEEP_SHIMS") == "1":
    # --real-tests: files of another transformers commit than the installed version may import names the installed
    # version dropped; each is given here only when missing: the tokenizers stand in for the slow-tokenizer-free
    # names, the decorators leave their test as it is (SDPA is always available in the torch the package needs)
    import transformers
    import transformers.testing_utils
    import transformers.utils

    def _keep(test):
        return test

    for _name in ("BloomTokenizerFast", "LlamaTokenizerFast"):
        if not hasattr(transformers, _name):
            setattr(transformers, _name, transformers.PreTrainedTokenizerFast)
    for _name in ("require_torch_sdpa", "require_read_token"):
        if not hasattr(transformers.testing_utils, _name):
            setattr(transformers.testing_utils, _name, _keep)
    if not hasattr(transformers.utils, "is_ipex_available"):  # Intel's extension: absent here, as the name said
        transformers.utils.is_ipex_available = lambda: False
    from transformers import GenerationConfig, StaticCache

    if not hasattr(StaticCache, "get_max_cache_shape"):  # the installed version's name of the same method
        StaticCache.get_max_cache_shape = StaticCache.get_max_length
    _validate = GenerationConfig.validate

    @functools.wraps(_validate)
    def _validate_dynamic_full(self, *args, **kwargs):
        # transformers' assisted-decoding tests ask for cache_implementation="dynamic_full" (a DynamicCache that
        # ignores sliding windows), a name the installed version dropped: its "dynamic" (none of these families
        # has a sliding window); every generate checks its config here
        if self.cache_implementation == "dynamic_full":
            self.cache_implementation = "dynamic"
        return _validate(self, *args, **kwargs)

    GenerationConfig.validate = _validate_dynamic_full


if FAMILY == "falcon" and os.environ.get("PLSH_SWEEP_FALCON_ALIBI") == "1":
    # --real-tests: transformers' Falcon tester builds rotary Falcons (FalconConfig's default, alibi=False), which the
    # swap refuses (only Falcon with alibi=True has ALiBi to replace); every config the tests make defaults to ALiBi
    # instead, in the stock runs too, so that stock and swapped runs test the same models
    import transformers

    _falcon_init = transformers.FalconConfig.__init__

    @functools.wraps(_falcon_init)
    def _alibi_init(self, *args, **kwargs):
        kwargs.setdefault("alibi", True)
        _falcon_init(self, *args, **kwargs)

    transformers.FalconConfig.__init__ = _alibi_init


_module = importlib.import_module(f"transformers.models.{FAMILY}.modeling_{FAMILY}")
for _obj in list(vars(_module).values()):
    if isinstance(_obj, type) and issubclass(_obj, PreTrainedModel):
        _wrap(_obj)
'''

EXPORT_STAND_IN = '''\
"""Stand-in (hf_model_tests.py): transformers' tests/exporters/test_export.py was not given."""


class ExportTesterMixin:
    pass
'''

PIPELINE_STAND_IN = '''\
"""Stand-in (hf_model_tests.py): transformers' tests/test_pipeline_mixin.py needs the git repository's layout
(tests/utils/tiny_model_summary.json, src/transformers, tests/pipelines/); the pipeline tests are not run."""


class PipelineTesterMixin:
    pass
'''

# --real-tests: the distributed mixins that transformers' CausalLMModelTest inherits (tensor parallelism, FSDP) run
# several processes and import ``tests/distributed_testing_utils.py``, which the source distribution does not ship;
# they are replaced by empty classes (no distributed tests), as the pipeline mixin is.
DISTRIBUTED_STAND_INS = {
    "test_tensor_parallel_mixin.py": "TensorParallelTesterMixin",
    "test_fsdp_mixin.py": "FSDPTesterMixin",
}

DISTRIBUTED_STAND_IN = '''\
"""Stand-in (hf_model_tests.py): transformers' tests/{name} runs several processes and needs
tests/distributed_testing_utils.py, which the source distribution does not ship; its tests are not run."""


class {cls}:
    pass
'''

GENERATION_STAND_IN = '''\
"""Stand-in (hf_model_tests.py): transformers' tests/generation/test_utils.py was not given.

A few generation checks of hf_model_tests.py's own: each compares the swapped model with itself.
"""
import copy

import torch

from transformers import DynamicCache


class GenerationTesterMixin:
    max_new_tokens = 4

    def _generation_inputs(self, batch_size=2):
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        config.pad_token_id = 0
        config.eos_token_id = None
        ids = inputs["input_ids"][:batch_size]
        return config, ids, torch.ones_like(ids)

    def _models(self):
        for model_class in self.all_generative_model_classes:
            config, ids, mask = self._generation_inputs()
            torch.manual_seed(0)
            yield model_class(config).eval(), ids, mask

    def _greedy(self, model, ids, mask, **kwargs):
        kwargs.setdefault("max_new_tokens", self.max_new_tokens)
        kwargs.setdefault("min_new_tokens", kwargs["max_new_tokens"])
        return model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)

    def test_greedy_generate_cache_matches_no_cache(self):
        for model, ids, mask in self._models():
            a = self._greedy(model, ids, mask, use_cache=True)
            b = self._greedy(model, ids, mask, use_cache=False)
            self.assertTrue(torch.equal(a, b))

    def test_assisted_decoding_matches_greedy(self):
        for model, ids, mask in self._models():
            a = self._greedy(model, ids[:1], mask[:1])
            b = self._greedy(model, ids[:1], mask[:1], assistant_model=model)
            self.assertTrue(torch.equal(a, b))

    def test_prompt_lookup_decoding_matches_greedy(self):
        for model, ids, mask in self._models():
            a = self._greedy(model, ids[:1], mask[:1])
            b = self._greedy(model, ids[:1], mask[:1], prompt_lookup_num_tokens=2)
            self.assertTrue(torch.equal(a, b))

    def test_static_cache_matches_dynamic(self):
        for model, ids, mask in self._models():
            a = self._greedy(model, ids, mask)
            b = self._greedy(model, ids, mask, cache_implementation="static")
            self.assertTrue(torch.equal(a, b))

    def test_continue_from_past_key_values(self):
        for model, ids, mask in self._models():
            full = self._greedy(model, ids, mask, max_new_tokens=4)
            cache = DynamicCache(config=model.config)
            first = self._greedy(
                model, ids, mask, max_new_tokens=2, past_key_values=cache, return_dict_in_generate=True
            )
            rest = self._greedy(
                model, first.sequences, torch.ones_like(first.sequences), max_new_tokens=2,
                past_key_values=first.past_key_values,
            )
            self.assertTrue(torch.equal(full, rest))

    def test_left_padding_matches_unpadded(self):
        for model, ids, mask in self._models():
            one = self._greedy(model, ids[:1, 2:], mask[:1, 2:])
            padded = ids[:1].clone()
            padded[:, :2] = 0
            pmask = mask[:1].clone()
            pmask[:, :2] = 0
            two = self._greedy(model, padded, pmask)
            self.assertTrue(torch.equal(one[:, -self.max_new_tokens:], two[:, -self.max_new_tokens:]))

    def test_beam_search_and_sampling_run(self):
        for model, ids, mask in self._models():
            out = self._greedy(model, ids, mask, num_beams=2, num_return_sequences=2)
            self.assertEqual(out.shape[0], 2 * ids.shape[0])
            torch.manual_seed(0)
            out = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=self.max_new_tokens)
            self.assertEqual(out.shape[0], ids.shape[0])
'''

# The family's stand-in tester: (config class, config keyword arguments, class names, mask kind)
TESTERS: dict[str, tuple[str, dict[str, object], tuple[str, ...], str]] = {
    "bloom": ("BloomConfig", {"hidden_size": 32, "n_layer": 2, "n_head": 4}, ("Bloom",), "random"),
    "falcon": (
        "FalconConfig",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "alibi": True},
        ("Falcon",),
        "random",
    ),
    "mpt": ("MptConfig", {"d_model": 32, "n_layers": 2, "n_heads": 4, "expansion_ratio": 2}, ("Mpt",), "random"),
    "llama": (
        "LlamaConfig",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 37,
        },
        ("Llama",),
        "tril",
    ),
    "qwen3": (
        "Qwen3Config",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 37,
        },
        ("Qwen3",),
        "tril",
    ),
}

TESTER_TEMPLATE = '''\
"""Stand-in tester (hf_model_tests.py): transformers' tests/models/{family}/test_modeling_{family}.py was not given."""
import os
import unittest

import torch

import transformers
from transformers.testing_utils import require_torch

from ...generation.test_utils import GenerationTesterMixin
from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

PREFIX = {prefix!r}
SUFFIXES = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


class StandInTester:
    batch_size = 13
    seq_length = 7
    vocab_size = 99
    num_labels = 3
    type_sequence_label_size = 2
    num_choices = 4
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    is_training = True
    use_input_mask = True
    use_labels = True

    def __init__(self, parent):
        self.parent = parent

    def get_config(self):
        return transformers.{config}(
            vocab_size=self.vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, **{kwargs!r}
        )

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        if {mask!r} == "random" and os.environ.get("PLSH_SWEEP_MASKS") != "contiguous":
            mask = random_attention_mask([self.batch_size, self.seq_length])
        else:
            mask = torch.tril(torch.ones_like(ids))
        return self.get_config(), {{"input_ids": ids, "attention_mask": mask}}


@require_torch
class {prefix}SweepTest(ModelTesterMixin, GenerationTesterMixin, unittest.TestCase):
    all_model_classes = tuple(getattr(transformers, PREFIX + s) for s in SUFFIXES if hasattr(transformers, PREFIX + s))

    def setUp(self):
        self.model_tester = StandInTester(self)
'''


@dataclass
class Cell:
    """The results of one family under one swap."""

    family: str
    swap: str
    passed: int = 0
    skipped: int = 0
    ran: bool = True  # False: no junit xml (not run, crashed or timed out)
    failures: dict[str, str] = field(default_factory=dict)  # test id -> first error line


def prepare(tests: Path | None, work: Path, family: str, real: Path | None = None) -> tuple[Path, list[str]]:
    """Write the scratch test package for ``family``; returns its test file and the stand-ins used.

    ``real`` (``--real-tests``): a folder laid out like transformers' ``tests/``, with files of the public repository
    (per-model test files, ``generation/test_utils.py``, helpers such as ``causal_lm_tester.py``); each of its
    ``.py`` files is copied over the scratch package, in place of the installed version's file or of a stand-in.
    """
    pkg = work / "hftests"
    stand_ins: list[str] = []
    if real is not None:
        tests_given = tests
        tests = work / "merged-tests"  # the installed version's files, then the real ones over them (made afresh)
        shutil.rmtree(tests, ignore_errors=True)
        if tests_given is not None:
            shutil.copytree(tests_given, tests, ignore=shutil.ignore_patterns("__pycache__"))
        for src in sorted(real.rglob("*.py")):
            dest = tests / src.relative_to(real)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest)
    if not pkg.exists():
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        if tests is None or not (tests / "test_modeling_common.py").exists():
            raise SystemExit("--tests: a transformers tests/ folder with test_modeling_common.py is needed")
        for src in sorted(tests.glob("*.py")):  # test_modeling_common.py and the helpers beside it (mixins, ...)
            shutil.copy(src, pkg / src.name)
        for sub in ("utils", "exporters", "generation", "models"):
            (pkg / sub).mkdir()
            (pkg / sub / "__init__.py").write_text("")
        (work / "conftest.py").write_text(CONFTEST)
        for src in sorted(real.rglob("*.py")) if real is not None else ():  # helpers too (causal_lm_tester.py, ...)
            dest = pkg / src.relative_to(real)
            for folder in dest.relative_to(pkg).parents:
                (pkg / folder).mkdir(exist_ok=True)
                (pkg / folder / "__init__.py").touch()
            shutil.copy(src, dest)
    if real is not None and not (real / "test_pipeline_mixin.py").exists():  # imported by the real per-model files
        (pkg / "test_pipeline_mixin.py").write_text(PIPELINE_STAND_IN)
        stand_ins.append("PipelineTesterMixin")
    if real is not None:  # imported by transformers' causal_lm_tester.py
        for name, cls in DISTRIBUTED_STAND_INS.items():
            (pkg / name).write_text(DISTRIBUTED_STAND_IN.format(name=name, cls=cls))
            stand_ins.append(cls)
    for rel, stand_in, label in (
        ("exporters/test_export.py", EXPORT_STAND_IN, "ExportTesterMixin"),
        ("generation/test_utils.py", GENERATION_STAND_IN, "GenerationTesterMixin"),
    ):
        if tests is not None and (tests / rel).exists():
            shutil.copy(tests / rel, pkg / rel)
        else:
            (pkg / rel).write_text(stand_in)
            stand_ins.append(label)
    fam_dir = pkg / "models" / family
    fam_dir.mkdir(exist_ok=True)
    (fam_dir / "__init__.py").write_text("")
    target = fam_dir / f"test_modeling_{family}.py"
    given = tests / "models" / family / target.name if tests is not None else None
    if given is not None and given.exists():
        shutil.copy(given, target)
    else:
        config, kwargs, (prefix,), mask = TESTERS[family]
        target.write_text(TESTER_TEMPLATE.format(family=family, prefix=prefix, config=config, kwargs=kwargs, mask=mask))
        stand_ins.append("tester")
    return target, stand_ins


def run_cell(
    target: Path,
    work: Path,
    family: str,
    swap: str,
    timeout: int,
    extra: Sequence[str],
    masks: str = "transformers",
    shims: bool = False,
) -> Cell:
    """One pytest process: the family's test file with ``swap`` on every model; parsed from its junit xml."""
    xml = work / f"{family}-{swap}.xml"
    xml.unlink(missing_ok=True)
    env = dict(os.environ, PLSH_SWEEP_SWAP=swap, PLSH_SWEEP_FAMILY=family, PLSH_SWEEP_MASKS=masks)
    env["PLSH_SWEEP_SHIMS"] = "1" if shims else "0"
    env["PLSH_SWEEP_FALCON_ALIBI"] = "1" if shims else "0"  # the real Falcon tester's configs: ALiBi (see CONFTEST)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work), env.get("PYTHONPATH", "")) if p)
    env.pop("RUN_SLOW", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(target.relative_to(work)),
        "-n",
        "0",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        "-o",
        "addopts=",
        "-W",
        "ignore",
        "--rootdir",
        str(work),
        *extra,
    ]
    try:
        subprocess.run(cmd, cwd=work, env=env, timeout=timeout, capture_output=True, check=False)
    except subprocess.TimeoutExpired:
        pass
    return read_cell(xml, family, swap)


def read_cell(xml: Path, family: str, swap: str) -> Cell:
    """The results of one family and swap, from the junit xml of its pytest run."""
    cell = Cell(family, swap)
    if not xml.exists():
        cell.ran = False
        return cell
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "?")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        # a failure wins over a skip: a test with subtests (``test_bc_cache_name_forward``) holds one element per
        # failed or skipped subtest, and some of its subtests can fail while others skip
        if bad is not None:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            cell.failures[name] = message[0][:200] if message else ""
        elif case.find("skipped") is not None:
            cell.skipped += 1
        else:
            cell.passed += 1
    return cell


def base_name(test_id: str) -> str:
    """The test's name without a parameterization suffix (``test_x_0_fp32`` -> ``test_x``)."""
    for name in (*STOCK_COMPARISONS, *BY_DESIGN, *DOCUMENTED):
        if test_id == name or test_id.startswith(name + "_"):
            return name
    return test_id


def classify(cell: Cell, stock: Cell | None) -> dict[str, list[str]]:
    """Each failure of ``cell``: ``stock comparison``, ``by design``, ``fails on stock too``, ``masks``,
    ``dropout``, ``documented`` or ``other``."""
    out: dict[str, list[str]] = {
        "stock comparison": [], "by design": [], "fails on stock too": [], "masks": [], "dropout": [],
        "documented": [], "other": [],
    }  # fmt: skip
    for test_id, message in cell.failures.items():
        if cell.swap == "stock" or (stock is not None and test_id in stock.failures):
            out["fails on stock too"].append(test_id)
        elif base_name(test_id) in STOCK_COMPARISONS:
            out["stock comparison"].append(test_id)
        elif base_name(test_id) in BY_DESIGN:
            out["by design"].append(test_id)
        elif base_name(test_id) in DOCUMENTED or CUSTOM_MASK_REFUSAL in message:
            out["documented"].append(test_id)
        elif any(m in message for m in MASK_REFUSALS):
            out["masks"].append(test_id)
        elif DROPOUT_REFUSAL in message:
            out["dropout"].append(test_id)
        else:
            out["other"].append(test_id)
    return out


def table(cells: list[Cell], stand_ins: dict[str, list[str]]) -> str:
    """The markdown table of the sweep and the list of the failures classified ``other``."""
    stock = {c.family: c for c in cells if c.swap == "stock"}
    lines = [
        "| family | swap | passed | failed | compares against stock numbers | checks the implementation name "
        "(by design) | fails on stock too | refuses masks with holes or packed sequences | refuses attention dropout "
        "in training (documented) | another documented limitation | other | skipped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    others: list[str] = []
    for c in cells:
        if not c.ran:
            lines.append(f"| {c.family} | {c.swap} | no result (not run, crashed or timed out) | | | | | | | | | |")
            continue
        kinds = classify(c, stock.get(c.family))
        lines.append(
            f"| {c.family} | {c.swap} | {c.passed} | {len(c.failures)} | {len(kinds['stock comparison'])} | "
            f"{len(kinds['by design'])} | {len(kinds['fails on stock too'])} | {len(kinds['masks'])} | "
            f"{len(kinds['dropout'])} | {len(kinds['documented'])} | {len(kinds['other'])} | {c.skipped} |"
        )
        others += [f"- {c.family} / {c.swap}: `{t}`: {c.failures[t]}" for t in kinds["other"]]
    used = sorted({s for v in stand_ins.values() for s in v})
    notes = [f"Stand-ins used: {', '.join(used) or 'none'}."]
    return "\n".join([*lines, "", *notes, "", "Failures classified `other`:", *(others or ["- none"])]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help="a transformers tests/ folder of the installed version")
    parser.add_argument(
        "--real-tests",
        type=Path,
        help="a folder laid out like transformers' tests/ with files of the public repository (models/<family>/"
        "test_modeling_<family>.py, generation/test_utils.py, causal_lm_tester.py, ...): used over --tests and in "
        "place of the stand-ins, with the installed version's missing names shimmed",
    )
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (made; outside the repository)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--swaps", nargs="+", default=list(SWAPS), choices=SWAPS)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per family and swap")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument(
        "--masks",
        choices=("transformers", "contiguous"),
        default="transformers",
        help="the stand-in testers' attention masks: transformers' testers' (random masks with holes for BLOOM, "
        "Falcon and MPT) or contiguous ones (tril, as for the Llama family) everywhere",
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a subset of the tests)")
    parser.add_argument(
        "--from-xml", action="store_true", help="run nothing: tabulate the <family>-<swap>.xml files already in --work"
    )
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    extra = ["-k", args.keyword] if args.keyword else []
    cells: list[Cell] = []
    stand_ins: dict[str, list[str]] = {}
    for family in args.families:
        if args.from_xml:
            given = args.tests is not None or args.real_tests is not None
            stand_ins[family] = prepare(args.tests, args.work, family, args.real_tests)[1] if given else []
        else:
            target, stand_ins[family] = prepare(args.tests, args.work, family, args.real_tests)
        for swap in args.swaps:
            if args.from_xml:
                cell = read_cell(args.work / f"{family}-{swap}.xml", family, swap)
            else:
                cell = run_cell(
                    target, args.work, family, swap, args.timeout, extra, args.masks, args.real_tests is not None
                )
            cells.append(cell)
            print(f"{family:7s} {swap:7s} passed {cell.passed:4d} failed {len(cell.failures):4d}", flush=True)
    text = table(cells, stand_ins)
    print(textwrap.dedent(text))
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
