"""The option sets of the op layer, each defined once: backends, kernels and estimator methods.

Two words, two meanings: a *backend* is what a caller chooses (``backend=``: :data:`BACKENDS`, with ``"auto"``); a
*kernel* is what the engine runs (:data:`KERNELS`: torch's two attention kernels, :data:`TORCH_KERNELS`, and the
Triton kernels). Every backend but ``"auto"`` names one kernel.

Every entry point that takes ``backend=`` or ``method=`` (``plsh_attention``, ``PositionalLSHAttention``,
``alibi_attention``, the language model's ``ModelConfig``, the transformers swap, context parallelism, the CLI)
checks it against these tuples; the defaults are stated here and nowhere else.
"""

from __future__ import annotations

from positional_lsh.ops.checks import check_choice

__all__ = [
    "ALIBI_BACKENDS",
    "BACKENDS",
    "DEFAULT_BACKEND",
    "DEFAULT_METHOD",
    "DEFAULT_SLOPE_GRAD",
    "KERNELS",
    "METHODS",
    "SLOPE_GRADS",
    "check_backend",
    "check_method",
    "check_slope_grad",
]

TORCH_KERNELS = ("flash", "math")
"""The torch attention kernels (``ops._engine.torch_attention``): torch's fused flash SDPA op of the CPU or CUDA (a
private ATen op; ``backend="flash"`` means it on the CPU too), and batched matmuls (any device)."""

KERNELS = (*TORCH_KERNELS, "triton")
"""Every kernel the engine runs: the torch kernels and ``"triton"`` (the Triton kernels of the multiplicity form)."""

BACKENDS = ("auto", *KERNELS)
"""``backend=``: ``"auto"`` (CPU and CUDA: ``"flash"``, other devices: ``"math"``; for positional LSH on CUDA the
Triton kernels whenever the multiplicity form is chosen, with triton installed), a torch kernel, or ``"triton"`` (the
Triton kernels of the multiplicity form; positional LSH only, exact ALiBi has no Triton path)."""

ALIBI_BACKENDS = ("auto", *TORCH_KERNELS)
"""``backend=`` of exact and windowed ALiBi (``alibi_attention``): the torch kernels only."""

METHODS = ("auto", "samples", "multiplicity")
"""``method=`` of the estimator: per sampled block (``"samples"``), each (query, key) pair once with its multiplicity
(``"multiplicity"``), or decided once per call by the cost model (``"auto"``)."""

SLOPE_GRADS = ("surrogate", "none")
"""``slope_grad=`` of the estimator when ``slopes`` requires grad: ``"surrogate"`` (the exact slope-gradient formula
``dL/dm_h = -sum_ij dS_ij |i - j|`` evaluated with the estimator's own ``dS``; biased at finite ``T``, consistent as
``T -> inf``) or ``"none"`` (the slopes get no gradient from the call)."""

DEFAULT_BACKEND = "auto"
DEFAULT_METHOD = "auto"
DEFAULT_SLOPE_GRAD = "surrogate"


def check_backend(backend: object, choices: tuple[str, ...] = BACKENDS) -> str:
    """``backend`` if it is one of ``choices`` (default :data:`BACKENDS`), else ``ValueError`` naming it."""
    if not isinstance(backend, str):
        raise ValueError(f"backend must be one of {choices}, got {backend!r}")
    check_choice("backend", backend, choices)
    return backend


def check_method(method: object) -> str:
    """``method`` if it is one of :data:`METHODS`, else ``ValueError`` naming it."""
    if not isinstance(method, str):
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_choice("method", method, METHODS)
    return method


def check_slope_grad(slope_grad: object) -> str:
    """``slope_grad`` if it is one of :data:`SLOPE_GRADS`, else ``ValueError`` naming it."""
    if not isinstance(slope_grad, str):
        raise ValueError(f"slope_grad must be one of {SLOPE_GRADS}, got {slope_grad!r}")
    check_choice("slope_grad", slope_grad, SLOPE_GRADS)
    return slope_grad
