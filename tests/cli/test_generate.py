"""plsh generate (issue 33): the shipped model and a plsh train-hf run directory continue a prompt file, the new
text streamed as it comes; bad input gets one line naming the flag or file, exit code 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from positional_lsh.cli import main
from positional_lsh.lm.checkpoint import load_checkpoint, shipped_checkpoint_path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_shipped_model_continues_a_prompt_file(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The history of the", encoding="utf-8")
    assert main(["generate", "--prompt-file", str(prompt), "--max-new-tokens", "12", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    ckpt = load_checkpoint(shipped_checkpoint_path())
    ids = torch.tensor([ckpt.tokenizer.encode("The history of the")])
    want = ckpt.model.generate(ids, 12, temperature=0.0, use_cache=False)  # greedy, recomputed without a cache
    assert printed == ckpt.tokenizer.decode(want[0, ids.shape[1] :].tolist()) + "\n"


@pytest.fixture(scope="module")
def hf_run(hf_text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-step ``plsh train-hf`` run directory (tiny Qwen3 swapped to plsh, its tokenizer)."""
    pytest.importorskip("transformers")
    from positional_lsh.cli import train_hf

    out = tmp_path_factory.mktemp("hf-run") / "run"
    flags = ["--out", str(out), "--preset", "tiny", "--data", str(hf_text_dir), "--cache-dir", ""]
    flags += ["--seq-len", "32", "--steps", "2", "--eval-interval", "2", "--ckpt-interval", "2", "--no-progress"]
    assert train_hf.main(flags) == 0
    return out


def test_a_train_hf_run_directory_generates_bounded_as_the_full_computation(hf_run, tmp_path, capsys):
    from transformers import DynamicCache

    from positional_lsh.integrations import hf
    from positional_lsh.integrations.hf.cache import LiveKeyCache
    from positional_lsh.integrations.hf.generation import GenerationCacheFactory
    from positional_lsh.lm.checkpoint import checkpoint_dir

    text = "one two three four five six seven eight nine ten " * 8
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text, encoding="utf-8")
    capsys.readouterr()
    code = main(["generate", str(hf_run), "--prompt-file", str(prompt), "--max-new-tokens", "10",
                 "--prefill-chunk", "16", "--threads", "1"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    loaded = hf.load_local_model(checkpoint_dir(hf_run), quiet=True)
    assert hf.current_swap(loaded.model) is not None and hf.current_swap(loaded.model).mode == "plsh"
    ids = torch.tensor([loaded.tokenizer(text, add_special_tokens=False)["input_ids"]])
    assert ids.shape[1] > 32  # several chunks of 16
    full = loaded.model.generate(ids, max_new_tokens=10, min_new_tokens=0, do_sample=False, use_cache=True,
                                 cache=DynamicCache(config=loaded.model.config), prefill_chunk_size=None)  # fmt: skip
    assert printed == loaded.tokenizer.decode(full[0, ids.shape[1] :], skip_special_tokens=True) + "\n"
    factory = loaded.model.__dict__["_prepare_cache_for_generation"]  # the swap's bounded defaults
    assert isinstance(factory, GenerationCacheFactory) and isinstance(factory.swap.new_cache(), LiveKeyCache)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "--prompt-file is required"),
        (["--prompt-file", "{tmp}/missing.txt"], "--prompt-file {tmp}/missing.txt: no such file"),
        (["--prompt-file", "{tmp}/empty.txt"], "--prompt-file {tmp}/empty.txt: the file is empty"),
        (["--prompt-file", "{tmp}/bad.txt"], "--prompt-file {tmp}/bad.txt: cannot read it as UTF-8 text"),
        (["{tmp}", "--prompt-file", "{tmp}/ok.txt"], "not a plsh train checkpoint, a transformers folder"),
        (["--prompt-file", "{tmp}/ok.txt", "--max-new-tokens", "0"], "argument --max-new-tokens"),
        (["--prompt-file", "{tmp}/ok.txt", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["a", "b", "--prompt-file", "{tmp}/ok.txt"], "takes one checkpoint"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag_and_changes_nothing(tmp_path, capsys, argv, expected):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    (tmp_path / "ok.txt").write_text("hello", encoding="utf-8")
    before = _snapshot(tmp_path)
    with pytest.raises(SystemExit) if "argument" in expected else _nothing() as exit_info:
        code = main(["generate", *(a.format(tmp=tmp_path) for a in argv)])
    if exit_info is not None:
        code = exit_info.value.code
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("plsh generate: error:"), err
    assert expected.format(tmp=tmp_path) in err[0] and "Traceback" not in captured.err
    assert captured.out == "" and _snapshot(tmp_path) == before


def test_debug_shows_the_traceback(tmp_path):
    from positional_lsh.ops.errors import UserError

    with pytest.raises(UserError, match="--prompt-file"):
        main(["--debug", "generate", "--prompt-file", str(tmp_path / "missing.txt")])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
