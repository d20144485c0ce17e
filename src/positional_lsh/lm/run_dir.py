"""The files of a ``plsh train`` run directory, written so that nothing is silently lost or mixed.

A run directory holds:

* ``train_config.json``: the training and model settings of the run (written once, when it starts);
* ``log.jsonl``: one JSON record per step and per validation;
* ``steps/step-NNNNNNNN-XXXXXXXX/``: the latest checkpoint as one set — ``config.json``, ``model.safetensors``,
  ``tokenizer.json`` and ``trainer_state.pt`` (optimizer and every random-number state);
* ``LATEST``: names that step directory.

A checkpoint set is written into a temporary directory, flushed to disk, renamed to its step directory, and only
then named by ``LATEST`` (replaced atomically); older step directories are removed afterwards. A process killed
at any point leaves ``LATEST`` naming a complete set, the old one or the new one. On resume, ``log.jsonl`` is cut
back to the checkpoint's step so the steps redone after a kill are not logged twice.

Runs written before step directories existed (the checkpoint files directly in the run directory) still load
and resume. Problems with these files raise :class:`~positional_lsh.ops.errors.UserError` naming the file.

Testing hook: ``PLSH_FAULT_PAUSE=SECONDS`` makes the checkpoint writer sleep between its files, so that tests
can kill a run in the middle of writing one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from positional_lsh.lm.checkpoint import (
    CONFIG_FILE,
    POINTER_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    checkpoint_dir,
    read_checkpoint_config,
    save_checkpoint,
)
from positional_lsh.lm.data.tokenizer import BPETokenizer
from positional_lsh.lm.model import TransformerLM
from positional_lsh.ops.errors import UserError

STATE_FILE = "trainer_state.pt"
TRAIN_CONFIG_FILE = "train_config.json"
LOG_FILE = "log.jsonl"
STEPS_DIR = "steps"
RESUME_MAY_CHANGE = ("steps", "eval_interval", "eval_batches", "ckpt_interval", "cache_dir")
"""Training settings a resumed run may change (the others define the run and must stay)."""

_RUN_FILES = (TRAIN_CONFIG_FILE, LOG_FILE, POINTER_FILE, STEPS_DIR, STATE_FILE, CONFIG_FILE, WEIGHTS_FILE)
_STATE_KEYS = ("step", "tokens", "elapsed", "val_loss", "model", "optimizer", "data_generator",
               "partition_steps", "torch_rng", "world_size")  # fmt: skip


def _fault_pause() -> None:
    """Sleep ``$PLSH_FAULT_PAUSE`` seconds (a testing hook: lets a test kill the writer between two files)."""
    pause = os.environ.get("PLSH_FAULT_PAUSE")
    if pause:
        time.sleep(float(pause))


def _fsync(path: Path) -> None:
    """Flush a file (or, where the system allows, a directory entry) to disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # directories cannot be fsync'ed on every system
    finally:
        os.close(fd)


def run_files(out: Path) -> list[Path]:
    """The files and directories of a previous run in ``out`` (empty for a new or unrelated directory)."""
    return [out / name for name in _RUN_FILES if (out / name).exists()]


def check_output_dir(path: Path | str, flag: str) -> None:
    """Check, leaving nothing behind, that directory ``path`` exists or can be created, and is writable.

    Raises :class:`UserError` naming ``flag`` when ``path`` is empty, when it (or a directory above it) is a file,
    or when the nearest existing directory does not take a new file — tried by creating and removing one, so that
    file systems where permission bits do not tell (``/proc``, read-only mounts, root's access) are caught too —
    before any work is done.
    """
    if not str(path).strip():
        raise UserError(f"{flag} must name a directory, got an empty path")
    path = Path(path).expanduser()
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is a file, not a directory; choose another {flag}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{flag} {path}: {parent} is not writable; choose another {flag}")
            try:
                fd, probe = tempfile.mkstemp(prefix=".plsh-write-test-", dir=parent)
            except OSError as exc:
                raise UserError(f"{flag} {path}: cannot create files in {parent} ({exc.strerror or exc}); "
                                f"choose another {flag}") from None  # fmt: skip
            os.close(fd)
            os.unlink(probe)
            return


def prepare_new_run(out: Path, *, overwrite: bool) -> None:
    """Check that ``out`` may receive a new run; with ``overwrite``, remove a previous run's files first.

    Raises :class:`UserError` when ``out`` is a file, lies under a file, or holds a previous run and
    ``overwrite`` is false. Nothing is changed on disk before the checks pass.
    """
    check_output_dir(out, "--out")
    old = run_files(out)
    if not old:
        return
    if not overwrite:
        raise UserError(
            f"--out {out} already holds a run ({', '.join(p.name for p in old)}); "
            "pass --resume to continue it or --overwrite to replace it"
        )
    if (out / TRAIN_CONFIG_FILE).exists() and (out / TOKENIZER_FILE).exists():
        old.append(out / TOKENIZER_FILE)  # the old run's tokenizer, not one prepared for this run
    for p in old:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def save_run_checkpoint(
    out: Path,
    model: TransformerLM,
    tokenizer: BPETokenizer,
    *,
    dtype: str,
    metadata: dict[str, Any],
    state: dict[str, Any],
) -> Path:
    """Write one checkpoint set (weights, config, tokenizer, trainer state) and point ``LATEST`` at it.

    Returns the step directory. See the module docstring for why a reader never sees a mixed set.
    """
    return write_checkpoint_set(
        out, state, lambda tmp: save_checkpoint(tmp, model, tokenizer, dtype=dtype, metadata=metadata)
    )


def write_checkpoint_set(out: Path, state: dict[str, Any], write_files: Callable[[Path], object]) -> Path:
    """Write one checkpoint set as :func:`save_run_checkpoint` does, with any model: ``write_files(directory)``
    writes the model's files into the (temporary) step directory, then ``state`` goes to ``trainer_state.pt``,
    the directory is renamed to ``steps/step-NNNNNNNN-XXXXXXXX`` (``NNNNNNNN`` = ``state["step"]``) and ``LATEST``
    names it. Used by ``plsh train`` and by ``plsh train-hf`` (transformers models). Returns the step directory.
    """
    steps = out / STEPS_DIR
    steps.mkdir(parents=True, exist_ok=True)
    name = f"step-{int(state['step']):08d}-{uuid.uuid4().hex[:8]}"
    tmp = steps / f".tmp-{name}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write_files(tmp)
        _fault_pause()
        torch.save(state, tmp / STATE_FILE)
        for written in tmp.iterdir():
            _fsync(written)
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk: OSError, SafetensorError, "unexpected pos"
        raise _write_failed(exc, tmp) from None
    _fault_pause()
    final = steps / name
    os.rename(tmp, final)
    _fsync(steps)
    _fault_pause()
    pointer_tmp = out / f".{POINTER_FILE}.tmp"
    with open(pointer_tmp, "w", encoding="utf-8") as f:
        f.write(f"{STEPS_DIR}/{name}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, out / POINTER_FILE)
    _fsync(out)
    clean_stale(out)
    return final


def _write_failed(exc: BaseException, tmp: Path) -> UserError:
    """The one-line error of a checkpoint set that could not be written, after removing its half-written directory
    (``LATEST`` still names the previous set, if any): "no space left on device" when the disk is full (the error
    says so, or under 1 MiB is free before the removal: torch.save's "unexpected pos" does not say why)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    try:
        free: int | None = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = None
    full = (
        (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
        or "No space left on device" in text
        or "os error 28" in text
        or (free is not None and free < 2**20)
    )
    shutil.rmtree(tmp, ignore_errors=True)
    previous = (tmp.parent.parent / POINTER_FILE).is_file()
    kept = "the previous checkpoint is kept" if previous else "no checkpoint yet"
    if full:
        then = "then pass --resume" if previous else "then start again (with --overwrite)"
        return UserError(f"no space left on device: the checkpoint could not be written into {tmp.parent} ({kept}; "
                         f"the half-written files are removed): free some space, {then}")  # fmt: skip
    return UserError(f"the checkpoint could not be written into {tmp.parent} ({text[:160]}; {kept})")


def clean_stale(out: Path) -> None:
    """Remove step directories ``LATEST`` does not name (older sets, half-written ones) and pre-step-directory
    checkpoint files superseded by a step directory. Without ``LATEST``, only half-written sets (``.tmp-*``)."""
    steps = out / STEPS_DIR
    if not steps.is_dir():
        return
    if not (out / POINTER_FILE).is_file():
        for p in steps.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return
    keep = checkpoint_dir(out)
    for p in steps.iterdir():
        if p != keep:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for legacy in (STATE_FILE, CONFIG_FILE, WEIGHTS_FILE):
        (out / legacy).unlink(missing_ok=True)


def write_train_config(out: Path, record: dict[str, Any]) -> None:
    """Write ``train_config.json`` (through a temporary name)."""
    _replace_text(out / TRAIN_CONFIG_FILE, json.dumps(record, indent=2) + "\n")


def _replace_text(file: Path, text: str) -> None:
    """Write ``text`` to ``file`` through a temporary name; on a write error (a full disk) the temporary file is
    removed, ``file`` is unchanged and the :class:`UserError` names it."""
    tmp = file.with_name(file.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, file)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _file_error(file, exc) from None


def _file_error(file: Path, exc: OSError) -> UserError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"no space left on device: {file} could not be written (unchanged); free some space")
    return UserError(f"{file} could not be written ({exc.strerror or exc})")


def read_train_config(out: Path) -> dict[str, Any]:
    """The run's ``train_config.json`` (``{"train": ..., "model": ...}``); ``UserError`` naming it if unusable."""
    file = out / TRAIN_CONFIG_FILE
    if not file.is_file():
        raise UserError(f"--resume: {out} holds no {TRAIN_CONFIG_FILE}; it is not a run directory to resume")
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc}); the run cannot be resumed") from None
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("train"), dict)
        or not isinstance(saved.get("model"), dict)
    ):
        raise UserError(f"{file} lacks its 'train' and 'model' objects; the run cannot be resumed")
    return saved


def read_state_file(out: Path, need: Sequence[str], prog: str) -> tuple[dict[str, Any], Path]:
    """The ``trainer_state.pt`` of the run's latest checkpoint and that checkpoint's directory.

    Raises :class:`UserError` naming the file when it is missing, unreadable, or lacks one of the fields ``need``
    (``prog``, e.g. ``"plsh train"``, names the command whose state it should be).
    """
    ckpt = checkpoint_dir(out)
    file = ckpt / STATE_FILE
    if not file.is_file():
        raise UserError(f"--resume: {out} holds no checkpoint with a {STATE_FILE} to resume from")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged pickle/zip
        msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{file} is corrupt or truncated ({msg}); the run cannot be resumed") from None
    if not isinstance(state, Mapping) or any(k not in state for k in need):
        raise UserError(f"{file} is not a trainer state of {prog} (missing fields); the run cannot be resumed")
    return dict(state), ckpt


def load_trainer_state(out: Path) -> tuple[dict[str, Any], Path]:
    """The trainer state of the run's latest checkpoint and that checkpoint's directory, checked for consistency.

    Raises :class:`UserError` naming the file when it is missing, unreadable, lacks fields, or belongs to another
    step than the checkpoint's ``config.json``.
    """
    state, ckpt = read_state_file(out, _STATE_KEYS, "plsh train")
    file = ckpt / STATE_FILE
    meta_step = read_checkpoint_config(ckpt).get("metadata", {}).get("step")
    if meta_step is not None and meta_step != state["step"]:
        raise UserError(f"{file} is at step {state['step']} but {ckpt / CONFIG_FILE} at step {meta_step}; "
                        "the checkpoint is inconsistent")  # fmt: skip
    return dict(state), ckpt


def append_log(out: Path, record: dict[str, Any]) -> None:
    """Append one JSON record to the run's ``log.jsonl``."""
    try:
        with open(out / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:
        raise _file_error(out / LOG_FILE, exc) from None


def truncate_log(out: Path, step: int) -> int:
    """Drop the records of ``log.jsonl`` after ``step`` (and a torn last line); return how many were dropped."""
    file = out / LOG_FILE
    if not file.is_file():
        return 0
    kept, dropped = [], 0
    for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        _replace_text(file, "".join(line + "\n" for line in kept))
    return dropped


def load_run(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """What resuming the run in ``out`` needs: its ``train_config.json`` record and the trainer state of its latest
    checkpoint, with that checkpoint's tokenizer under ``"tokenizer"``.

    The tokenizer must have the fingerprint recorded in the checkpoint (and the run directory's own
    ``tokenizer.json``, if any, the same): else :class:`UserError` with both fingerprints.
    """
    from positional_lsh.lm.checkpoint import check_tokenizer_fingerprint

    saved = read_train_config(out)
    state, ckpt = load_trainer_state(out)
    expected = read_checkpoint_config(ckpt).get("tokenizer_fingerprint") or state.get("tokenizer_fingerprint")
    files = [f for f in (ckpt / TOKENIZER_FILE, out / TOKENIZER_FILE) if f.is_file()]
    if not files:
        raise UserError(f"--resume: {ckpt} holds no {TOKENIZER_FILE}; the run cannot be resumed")
    for f in dict.fromkeys(files):
        try:
            tok = BPETokenizer.load(f)
        except (OSError, ValueError) as exc:
            raise UserError(f"{f} is not a valid tokenizer ({str(exc).splitlines()[0][:120]})") from None
        check_tokenizer_fingerprint(tok, expected, where=str(f))
        state.setdefault("tokenizer", tok)
    return saved, state


PER_JOB_SETTINGS = ("out_dir", "stop_after", "progress", "device")
"""Settings of a resumed run taken from the resuming call, not the saved run (and ``threads`` when given)."""


def per_job_settings(cfg: Any, saved_train: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a resumed run takes from ``cfg`` (:data:`PER_JOB_SETTINGS`) and its thread count: ``cfg``'s
    when set, else the saved run's (``saved_train``, the saved ``"train"`` settings)."""
    keep = {k: getattr(cfg, k) for k in PER_JOB_SETTINGS}
    keep["threads"] = cfg.threads or saved_train.get("threads")
    return keep


def check_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` if every key is in :data:`RESUME_MAY_CHANGE`; else ``UserError`` naming the first other."""
    for name in changes:
        if name not in RESUME_MAY_CHANGE:
            raise UserError(f"--resume: {name} defines the run and cannot change (only {', '.join(RESUME_MAY_CHANGE)})")
    return dict(changes)


def trainer_state(
    model: TransformerLM, opt: torch.optim.Optimizer, data_gen: torch.Generator, counters: dict[str, Any]
) -> dict[str, Any]:
    """The exact resume state: ``counters`` (step, tokens, ...), weights, optimizer and every random-number state."""
    return {
        **counters,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "data_generator": data_gen.get_state(),
        "partition_steps": model.rng_state(),
        "torch_rng": torch.get_rng_state(),
    }


def restore_trainer_state(
    state: dict[str, Any], model: TransformerLM, opt: torch.optim.Optimizer, data_gen: torch.Generator, world: int
) -> dict[str, Any]:
    """Load a :func:`trainer_state` into the model, optimizer and generators; return the run's counters."""
    if state["world_size"] != world:
        raise UserError(
            f"--resume: the run was saved with {state['world_size']} processes; resume it with the same number "
            f"(got {world}) so that the batches stay the same"
        )
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_generator"])
        model.set_rng_state(state["partition_steps"])
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{STATE_FILE} does not fit the run's model ({' '.join(str(exc).split())[:160]})") from None
    return {k: state[k] for k in ("step", "tokens", "elapsed", "val_loss")} | {"saved_step": state["step"]}
