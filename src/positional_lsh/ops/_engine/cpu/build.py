"""Building and loading the CPU kernel (``attention.cpp`` beside this module) at first use, once, and
``PLSH_CPU_KERNEL``.

The source is compiled by ``torch.utils.cpp_extension.load`` (ninja and a C++ compiler; ATen headers only, the ops
registered with ``TORCH_LIBRARY`` as ``torch.ops.plsh_cpu.*``) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name that holds a hash of the source (its
text and path), the flags and the torch version: a later process loads the cached library in well under a second.

``PLSH_CPU_KERNEL`` (environment variable, read at each call of :func:`kernel_state`):

* unset (or empty): the kernel is used where it builds. Without a compiler or ninja, one warning (one line, naming
  the cause and ``PLSH_CPU_KERNEL=0``) and the torch path; a build that fails is reported by a warning with the
  compiler's message (never silently) and the torch path is taken;
* ``0``: the torch path, nothing built;
* ``1``: the kernel is required: a call that cannot build it raises ``RuntimeError`` (one line, the cause).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "ENV", "SOURCE", "KernelState", "build_kernel", "build_lock", "cpu_flags", "kernel_state", "kernel_unavailable",
    "load_kernel", "missing_tool", "reset",
]  # fmt: skip

#: The environment variable that switches the kernel off (``0``) or requires it (``1``).
ENV = "PLSH_CPU_KERNEL"
#: The kernel's source.
SOURCE = Path(__file__).with_name("attention.cpp")

_LOCK = threading.Lock()
_STATE: KernelState | None = None


@dataclass(frozen=True)
class KernelState:
    """Whether the kernel can run in this process, and why not.

    Attributes:
        loaded: the ops ``torch.ops.plsh_cpu.*`` are registered.
        reason: why not (``None`` when loaded): ``PLSH_CPU_KERNEL=0``, the missing tool, or the build error.
    """

    loaded: bool
    reason: str | None = None


def cpu_flags() -> list[str]:
    """The compiler flags for this machine's vector unit (``torch.backends.cpu.get_cpu_capability``): at::vec's
    AVX-512 or AVX2 code where the CPU has it, its scalar fallback elsewhere; ``-fopenmp`` where torch's parallel
    backend is OpenMP, whose ``at::parallel_for`` is compiled into the kernel."""
    cap = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffp-contract=off", "-DNDEBUG"]
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        flags.append("-fopenmp")  # at::parallel_for is inline OpenMP: without the flag it runs on one thread
    if cap.startswith("AVX512"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        flags += ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    elif cap == "AVX2":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags


def missing_tool() -> str | None:
    """What the build lacks (a C++ compiler, ninja), or ``None``. ninja from the ``ninja`` package is put on
    ``PATH`` first."""
    try:
        import ninja  # type: ignore[import-not-found,unused-ignore]

        bin_dir = str(getattr(ninja, "BIN_DIR", ""))
        if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build directory against other processes while torch builds or loads there, and clear a lock that a
    killed build left.

    torch's own lock (``build_dir/lock``, created with ``O_EXCL``) stays behind when a build is interrupted (Ctrl-C,
    a killed test run), and every later process then waits for it forever, silently. This lock is an ``flock`` on
    ``build_dir/plsh.flock``, which the operating system releases when its holder exits: while it is held no other
    process of this package is building here, so a ``lock`` file found then is stale and is removed. A process that
    finds the directory held says so in one line and waits. Where ``fcntl`` does not exist (Windows) only torch's
    lock applies.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "plsh.flock", "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("positional_lsh: waiting for another process building the CPU kernel…", file=sys.stderr, flush=True)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # stale: no live build of ours holds the directory
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_kernel() -> None:
    """Compile (or load from the cache) and register the ops; prints one line to stderr when it compiles."""
    from torch.utils import cpp_extension

    flags = cpu_flags()
    # the source's path too: ninja rebuilds when build.ninja names another path, so two checkouts of one source
    # sharing a directory would rebuild each other's kernel at every switch
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + torch.__version__.encode())
    digest.update(str(SOURCE.resolve()).encode())
    name = f"plsh_cpu_{digest.hexdigest()[:12]}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    build_dir = root / name
    with build_lock(build_dir):
        if not (build_dir / f"{name}.so").exists():
            print("positional_lsh: building the CPU kernel (once)…", file=sys.stderr, flush=True)
        cpp_extension.load(
            name=name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(build_dir),
            is_python_module=False, verbose=False,
        )  # fmt: skip


def load_kernel() -> KernelState:
    """Build or load the kernel once per process (thread-safe); :func:`kernel_state` without ``PLSH_CPU_KERNEL``."""
    global _STATE
    with _LOCK:
        if _STATE is not None:
            return _STATE
        missing = missing_tool()
        if missing is not None:
            _STATE = KernelState(False, missing)
        else:
            try:
                build_kernel()
                _STATE = KernelState(True)
            except Exception as err:  # the compiler's error: reported by the caller, never dropped
                first = str(err).strip() or type(err).__name__
                _STATE = KernelState(False, f"the build failed: {first}")
        return _STATE


_WARNED: set[str] = set()


def kernel_state() -> KernelState:
    """Whether the CPU kernel runs here, after ``PLSH_CPU_KERNEL``: ``0`` → not loaded (nothing built); ``1`` → built
    or ``RuntimeError``; unset → built where it can be, else one warning (once per cause) and not loaded."""
    mode = os.environ.get(ENV, "").strip()
    if mode not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 (the torch path), 1 (require the CPU kernel) or unset, got {mode!r}")
    if mode == "0":
        return KernelState(False, f"{ENV}=0")
    state = load_kernel()
    if state.loaded:
        return state
    if mode == "1":
        raise RuntimeError(f"{ENV}=1 but the CPU kernel cannot be built: {state.reason.splitlines()[0]}")  # type: ignore[union-attr]
    reason = str(state.reason)
    if reason not in _WARNED:
        _WARNED.add(reason)
        if reason.startswith("the build failed"):
            warnings.warn(
                f"positional_lsh: the CPU kernel did not build; the torch path runs instead (set {ENV}=0 to skip "
                f"the build): {reason}",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            warnings.warn(
                f"positional_lsh: the CPU kernel cannot be built ({reason}); the torch path runs instead (set {ENV}=0 "
                "to silence this)",
                RuntimeWarning,
                stacklevel=3,
            )
    return state


@torch.compiler.assume_constant_result
def kernel_unavailable() -> str:
    """``""`` where the kernel runs in this process, else why not (:func:`kernel_state`'s reason): what the routing
    reads, a constant to ``torch.compile`` (computed once when a call is traced, not traced itself)."""
    state = kernel_state()
    return "" if state.loaded else str(state.reason)


def reset() -> None:
    """Forget the build's outcome and the warnings given (tests: a fresh process's first call)."""
    global _STATE
    with _LOCK:
        _STATE = None
        _WARNED.clear()
