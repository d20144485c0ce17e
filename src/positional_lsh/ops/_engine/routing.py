"""The one place a call's backend is decided: the backends' refusals, the priority list, the cost model's choice.

Strings exist only at the public boundary (``backend=``, ``method=``: ``ops.options``); inside the engine a kernel is
a :class:`~positional_lsh.ops._engine.kinds.Kernel` and a method a :class:`~positional_lsh.ops._engine.kinds.Method`.

How a call runs is decided in two steps, because part of it depends on the partition values, which are drawn after
the arguments are checked:

1. :func:`dispatch`, where the inputs are known (``plsh_attention``, before the draw): for each method the call may
   run (``method="auto"``: both), the first row of :data:`PRIORITY` that ``backend=`` allows and whose backend does
   not refuse the inputs (:func:`refusal`: device, dtype, head dim, masks, sizes; in the spirit of xformers'
   ``not_supported_reasons``). The result is a :class:`Route`: the method asked for and the kernel of each method.
   A forced choice (``backend`` other than ``"auto"``, or a forced ``method``) that no backend can run raises one
   ``ValueError`` listing every candidate's reason. There is no fallback later: each kernel call runs the kernel
   decided here.
2. :func:`decide`, inside the op, from the route and the partitions: ``method="auto"`` becomes a method by the cost
   model (:mod:`~positional_lsh.ops._engine.cost`) where the route has a kernel for both, and the
   ``(method, kernel)`` pair picks the backend from :data:`BACKEND_TABLE`, the one table of backends.

:func:`plan` is the decision and the backend's own plan (host-side), what ``ops._engine.engine.forward`` and
``backward`` run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from positional_lsh.ops._engine.backend import Backend
from positional_lsh.ops._engine.cost import (
    AUTO_MARGIN,
    AutoEstimate,
    auto_method,
    kernel_auto_method,
    samples_estimate,
    samples_floor,
)
from positional_lsh.ops._engine.cpu.backend import CPU_KERNEL, DTYPES, MAX_HEAD_DIM
from positional_lsh.ops._engine.cpu.build import kernel_unavailable
from positional_lsh.ops._engine.kinds import Kernel, Method
from positional_lsh.ops._engine.multiplicity.backend import MULTIPLICITY_FLASH, MULTIPLICITY_MATH
from positional_lsh.ops._engine.multiplicity.plan import multiplicity_plan, tilings
from positional_lsh.ops._engine.per_sample import PER_SAMPLE_FLASH, PER_SAMPLE_MATH, samples_plan
from positional_lsh.ops._engine.torch_attention import FLASH_DEVICES, flash_refusal
from positional_lsh.ops.checks import as_scale, check_bool
from positional_lsh.ops.options import ALIBI_BACKENDS, check_backend, check_method
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "BACKEND_TABLE", "DECODE_KERNEL", "DECODE_METHOD", "PRIORITY", "Decision", "Inputs", "Plan", "Route", "backend_for",
    "cpu_kernel_refusal", "decide", "decode_forced", "dispatch", "exact_kernel", "plan", "refusal", "sized_method",
    "torch_kernel",
    "triton_device", "triton_installed",
]  # fmt: skip

P = TypeVar("P")


PRIORITY: tuple[tuple[Method, Kernel], ...] = (
    (Method.MULTIPLICITY, Kernel.TRITON),
    (Method.MULTIPLICITY, Kernel.CPU),
    (Method.SAMPLES, Kernel.FLASH),
    (Method.MULTIPLICITY, Kernel.FLASH),
    (Method.SAMPLES, Kernel.MATH),
    (Method.MULTIPLICITY, Kernel.MATH),
)
"""The backends in the order :func:`dispatch` tries them, per method: the first that ``backend=`` allows and that
does not refuse the inputs runs that method."""


def _triton() -> Backend[Any]:
    from positional_lsh.ops._engine.triton.host import TRITON  # lazy: importing it imports triton

    return TRITON


BACKEND_TABLE: dict[tuple[Method, Kernel], Callable[[], Backend[Any]]] = {
    (Method.SAMPLES, Kernel.FLASH): lambda: PER_SAMPLE_FLASH,
    (Method.SAMPLES, Kernel.MATH): lambda: PER_SAMPLE_MATH,
    (Method.MULTIPLICITY, Kernel.FLASH): lambda: MULTIPLICITY_FLASH,
    (Method.MULTIPLICITY, Kernel.MATH): lambda: MULTIPLICITY_MATH,
    (Method.MULTIPLICITY, Kernel.TRITON): _triton,
    (Method.MULTIPLICITY, Kernel.CPU): lambda: CPU_KERNEL,
}
"""The backends, one per (method, kernel): each row gives the object implementing
:class:`~positional_lsh.ops._engine.backend.Backend` (a function, so that a row's module is imported only when the
row is taken: the Triton row imports triton). Adding a backend is one module, one row here and one of
:data:`PRIORITY`."""


def backend_for(method: Method, kernel: Kernel) -> Backend[Any]:
    """The backend of :data:`BACKEND_TABLE` that computes ``method`` with ``kernel``; ``ValueError`` for a pair
    without one."""
    row = BACKEND_TABLE.get((Method(method), Kernel(kernel)))
    if row is None:
        pairs = sorted((m.value, k.value) for m, k in BACKEND_TABLE)
        raise ValueError(f"no backend computes method='{method}' with kernel='{kernel}'; the pairs are {pairs}")
    return row()


def triton_installed() -> bool:
    """Whether triton can be imported (``find_spec``: without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_device(device: torch.device) -> bool:
    """Whether ``backend="auto"`` may send the multiplicity form on ``device`` to the Triton kernels: CUDA devices.

    The one device test of :func:`dispatch` (tests replace it to check the routing of CUDA calls without a GPU).
    """
    return device.type == "cuda"


@dataclass(frozen=True)
class Inputs:
    """What the refusals read of a call: ``q``'s device, dtype and head dim, the query and key lengths, the causal
    mask and whether a ``key_padding_mask`` splits the batch into row groups (each with its own lengths). ``q`` is
    the tensor itself (or a stand-in with ``shape``, ``dtype`` and ``device``), for the Triton check."""

    q: Any
    k_len: int
    causal: bool
    padded: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device(self.q.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[-1])

    @property
    def q_len(self) -> int:
        return int(self.q.shape[-2])


def _flash_refusal(method: Method, inputs: Inputs) -> str | None:
    device = inputs.device
    if device.type not in FLASH_DEVICES:
        return f"torch's fused flash op runs on the CPU or CUDA; tensors are on {device}"
    masked = method is Method.MULTIPLICITY  # every call of the multiplicity form carries the mask log c
    why = flash_refusal(device, inputs.dtype, inputs.head_dim, masked)
    if why is not None or device.type == "cpu":
        return why
    if inputs.causal and (inputs.q_len != inputs.k_len or inputs.padded):
        # The CUDA op aligns its causal mask to the first key: the block a first query cuts cannot run on it.
        return "causal with Lq != Lk (or row groups of a key_padding_mask): the CUDA op aligns its causal mask"
    q = inputs.q
    if isinstance(q, torch.Tensor) and q.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
        if not torch.backends.cuda.can_use_flash_attention(params, False):
            return "torch's check (torch.backends.cuda.can_use_flash_attention)"
    return None


def _triton_refusal(inputs: Inputs, forced: bool) -> str | None:
    if not forced and not triton_device(inputs.device):
        return "backend='auto' takes the Triton kernels on CUDA devices only"
    if not forced and not triton_installed():
        return "triton is not installed"
    from positional_lsh.ops._engine.triton.host import check_triton_call, triton_refusal  # lazy: triton is optional

    if forced:
        check_triton_call(inputs.q)  # ImportError without triton (the optional dependency)
    return triton_refusal(inputs.q)


def cpu_kernel_refusal(device: torch.device, dtype: torch.dtype, head_dim: int, q_len: int, k_len: int) -> str | None:
    """Why the CPU kernel (``ops._engine.cpu``) cannot run a call (``None`` if it can): another device, a dtype other
    than float32/bfloat16/float16 (float64 runs on the torch path), a head dim above ``MAX_HEAD_DIM``, more queries
    than keys or ``2**31 - 1`` keys, ``PLSH_CPU_KERNEL=0``, or a kernel that does not build here (the build's
    outcome: ``ops._engine.cpu.build.kernel_state``, which warns once, or raises under ``PLSH_CPU_KERNEL=1``)."""
    if device.type != "cpu":
        return f"the CPU kernel runs on the CPU; tensors are on {device}"
    if dtype not in DTYPES:
        return f"the CPU kernel takes float32, bfloat16 or float16, got {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"the CPU kernel takes head dims up to {MAX_HEAD_DIM}, got {head_dim}"
    if q_len > k_len or k_len >= 2**31 - 1:
        return f"the CPU kernel takes Lq <= Lk < 2**31 - 1, got Lq={q_len}, Lk={k_len}"
    why = kernel_unavailable()
    return f"the CPU kernel is not available: {why}" if why else None


def refusal(method: Method, kernel: Kernel, inputs: Inputs, forced: bool = False) -> str | None:
    """Why the backend ``(method, kernel)`` cannot run a call of ``inputs`` (``None`` if it can).

    * ``("multiplicity", "triton")``: triton missing, the dtype (float32/bfloat16/float16), the head dim (<= 256),
      CPU tensors without Triton's interpreter; ``backend="auto"`` (not ``forced``) also needs a CUDA device
      (:func:`triton_device`) and triton installed;
    * ``"flash"``: tensors on a device other than the CPU and CUDA; on CUDA (``"meta"`` stands for it) an additive
      mask (the multiplicity form), a dtype other than float16/bfloat16, a head dim that is not a multiple of 8 or
      above 256, a GPU older than sm_80, causal calls with ``Lq != Lk`` or row groups, torch's own check;
    * ``("multiplicity", "cpu")``: :func:`cpu_kernel_refusal`;
    * ``"math"``: never.
    """
    if (method, kernel) not in BACKEND_TABLE:
        return f"no backend computes method={method.value!r} with kernel={kernel.value!r}"
    if kernel is Kernel.TRITON:
        return _triton_refusal(inputs, forced)
    if kernel is Kernel.FLASH:
        return _flash_refusal(method, inputs)
    if kernel is Kernel.CPU:
        return cpu_kernel_refusal(inputs.device, inputs.dtype, inputs.head_dim, inputs.q_len, inputs.k_len)
    return None


@dataclass(frozen=True)
class Route:
    """How a call runs, from its arguments and inputs (see :func:`dispatch`).

    Attributes:
        method: the method asked for (``Method.AUTO``: :func:`decide` picks one from the partitions).
        samples: the kernel of the per-sample path, or ``None`` where the call may not take it.
        multiplicity: the kernel of the multiplicity form, or ``None`` where the call may not take it.
        compiled: whether the call is traced by ``torch.compile`` (then it runs the custom ops).
        causal: the causal mask.
        scale: the score scale.
    """

    method: Method
    samples: Kernel | None
    multiplicity: Kernel | None
    compiled: bool
    causal: bool
    scale: float

    def kernel_of(self, method: Method) -> Kernel:
        """The kernel that runs ``method`` (a method the route allows)."""
        kernel = self.samples if method is Method.SAMPLES else self.multiplicity
        if kernel is None:
            raise ValueError(f"this call's route does not run method={method.value!r}")
        return kernel


def dispatch(
    q: Any,
    *,
    causal: object,
    scale: float | None,
    backend: object,
    method: object,
    k_len: int | None = None,
    padded: bool = False,
) -> Route:
    """The route of a call: for each method it may run, the first backend of :data:`PRIORITY` that ``backend``
    allows and that does not :func:`refusal` the inputs (``q (B, Hq, Lq, d)``: device, dtype, head dim; ``k_len``
    keys, default ``Lq``; ``padded``: a ``key_padding_mask``).

    * ``backend="auto"``: every kernel, in priority order: on CUDA with triton installed the multiplicity form on
      the Triton kernels (the per-sample path on torch's CUDA flash op, or the math kernel where that op refuses
      the inputs); on the CPU torch's fused flash op for both methods; elsewhere the math kernel;
    * ``backend="flash"``, ``"math"``, ``"triton"``: that kernel only (``"triton"`` computes the multiplicity form;
      ``method="auto"`` means it there);
    * ``method="auto"`` keeps both methods where both have a kernel (:func:`decide` picks one from the partitions);
      a forced method keeps its own.

    A forced choice that cannot run raises one ``ValueError`` listing every candidate's reason (without triton,
    ``backend="triton"`` raises ``ImportError``). Validates ``causal`` (bool), ``scale`` (positive float or ``None``:
    ``1/sqrt(d)``), ``backend`` (``ops.options.BACKENDS``) and ``method`` (``ops.options.METHODS``), naming the
    argument on error. Reads only ``q.shape``, ``q.dtype`` and ``q.device``.
    """
    causal = check_bool("causal", causal)
    scale_f = as_scale(scale, q.shape[-1])
    asked = Method(check_method(method))
    name = check_backend(backend)
    if name == "triton" and asked is Method.SAMPLES:
        raise ValueError(
            "backend='triton' computes method='multiplicity' (or 'auto', which means it there), got method='samples'"
        )
    inputs = Inputs(q, int(q.shape[-2]) if k_len is None else int(k_len), causal, padded)
    methods = (Method.SAMPLES, Method.MULTIPLICITY) if asked is Method.AUTO else (asked,)
    allowed = tuple(Kernel) if name == "auto" else (Kernel(name),)
    kernels: dict[Method, Kernel] = {}
    reasons: list[str] = []
    for m, kernel in PRIORITY:
        if m not in methods or kernel not in allowed or m in kernels:
            continue
        why = refusal(m, kernel, inputs, forced=name != "auto")
        if why is None:
            kernels[m] = kernel
        else:
            reasons.append(f"({m.value}, {kernel.value}): {why}")
    if not kernels:
        raise ValueError(
            f"backend={name!r} with method={asked.value!r} cannot run these inputs ({inputs.dtype}, head dim "
            f"{inputs.head_dim}, on {inputs.device}): " + "; ".join(reasons)
        )
    compiling = torch.compiler.is_compiling()
    return Route(asked, kernels.get(Method.SAMPLES), kernels.get(Method.MULTIPLICITY), compiling, causal, scale_f)


def sized_method(backend: str, method: str) -> str:
    """The method whose cost the up-front size check estimates for a call with ``backend`` and ``method`` (public
    names): ``backend="triton"`` computes the multiplicity form."""
    return Method.MULTIPLICITY.value if backend == Kernel.TRITON else method


#: What the decoding kernels (``ops._decode``) are: the multiplicity form in torch's matmuls.
DECODE_KERNEL, DECODE_METHOD = Kernel.MATH, Method.MULTIPLICITY


def decode_forced(backend: str, method: str) -> list[tuple[str, str]]:
    """``(name, value)`` of each of the checked public ``backend``, ``method`` that the decoding kernels are not
    (:data:`DECODE_KERNEL`, :data:`DECODE_METHOD`; ``"auto"`` takes them): a KV-cache call that forces one runs the
    full op with that choice (``ops.kvcache``)."""
    asked = (("backend", backend, DECODE_KERNEL), ("method", method, DECODE_METHOD))
    return [(name, value) for name, value, ok in asked if value not in ("auto", ok)]


def exact_kernel(backend: object, q: Any, op: str) -> Kernel:
    """The kernel an exact op (``alibi_attention``, ``decay_attention``: ``op``) runs for ``backend`` on ``q``: with
    ``"auto"`` the CPU kernel where it takes ``q`` (:func:`cpu_kernel_refusal`), else :func:`torch_kernel` of its
    additive bias, the math kernel (float32 scores) for half types. ``ValueError``
    naming ``backend`` for ``"triton"`` (exact ALiBi has no Triton path), a name outside ``ALIBI_BACKENDS``, and an
    explicit ``"flash"`` with a half type (the fused op would round the bias to 8 bits) or where the op refuses."""
    if backend == Kernel.TRITON:
        raise ValueError(
            f"backend='triton' is not available for {op}: exact ALiBi has no Triton path "
            f"(the Triton kernels are positional LSH's); backend must be one of {ALIBI_BACKENDS}"
        )
    name = check_backend(backend, ALIBI_BACKENDS)
    q_len = int(q.shape[-2])
    if name == "auto" and cpu_kernel_refusal(q.device, q.dtype, int(q.shape[-1]), q_len, q_len) is None:
        return Kernel.CPU  # the exact biases inside the CPU kernel's loop (one line per head)
    kernel = torch_kernel(name, q.device, masked=True)
    if q.dtype in (torch.float16, torch.bfloat16):
        if name == Kernel.FLASH:
            raise ValueError(
                f"backend='flash' is not supported for {q.dtype} in {op}: the fused op would round the "
                "bias to the input precision. Use backend='math' or 'auto' (float32 scores)"
            )
        kernel = Kernel.MATH
    return kernel


def torch_kernel(backend: str, device: torch.device, masked: bool) -> Kernel:
    """The torch kernel an op outside the estimator (the exact ops, decoding) runs for ``backend`` in
    ``ops.options.ALIBI_BACKENDS`` on ``device``: ``"auto"`` is torch's fused flash op where it takes the calls
    (the CPU; on CUDA only without an additive mask, ``masked``) and the math kernel elsewhere; ``"flash"`` where
    the op refuses the calls (another device, or CUDA with ``masked``) raises ``ValueError``."""
    if backend == "auto":
        if device.type == "cpu" or (device.type in FLASH_DEVICES and not masked):
            return Kernel.FLASH
        return Kernel.MATH
    kernel = Kernel(backend)
    if kernel is Kernel.FLASH and device.type not in FLASH_DEVICES:
        raise ValueError(
            f"backend='flash' uses torch's fused flash-attention op of the CPU or CUDA; tensors are on {device}. "
            "Use 'math'"
        )
    why = flash_refusal(device, None, None, masked) if kernel is Kernel.FLASH else None
    if why is not None:
        raise ValueError(
            f"backend='flash': torch's fused flash op of {device.type} refuses {why}. Use 'math' or 'auto'"
        )
    return kernel


@dataclass(frozen=True)
class Decision(Generic[P]):
    """What runs a call (see :func:`decide`).

    Attributes:
        method: the method, resolved.
        kernel: the kernel that runs it (the route's for that method).
        backend: the backend of :data:`BACKEND_TABLE` for ``(method, kernel)``.
        prepared: the backend's plan where deciding built it (``method="auto"`` estimates from the plans), so that
            :func:`plan` does not build it again; else ``None``.
    """

    method: Method
    kernel: Kernel
    backend: Backend[P]
    prepared: P | None = None


def decide(route: Route, partitions: Partitions, num_kv_heads: int, q_len: int) -> Decision[Any]:
    """What runs the call that :func:`dispatch` routed, now that its partitions are drawn (host-side).

    ``method="auto"`` with a kernel for both methods builds each head's cheapest multiplicity tiling and the
    per-sample plan (not built where the tiling wins even against its lower bound, ``cost.samples_floor``: the
    choice is the same) and lets the cost model choose (``ops._engine.cost.auto_method``: one sample never takes the
    multiplicity form, it would compute the same pairs plus a mask; a call whose per-sample planning alone would
    take minutes takes the multiplicity form without it, ``AutoEstimate.up_front``); the chosen plan is kept
    (``Decision.prepared``). With one method in the route (forced, or the only one that can run) it is taken.
    """
    method = route.method
    if method is Method.AUTO:
        method = Method.SAMPLES if route.multiplicity is None else Method.MULTIPLICITY
        if route.samples is not None and route.multiplicity is not None:
            method = Method.AUTO
    samples = None
    tiles = None
    heads = list(range(partitions.num_heads))
    if method is Method.AUTO and route.multiplicity is Kernel.CPU:  # the kernel's cost model: ops._engine.cost
        method = kernel_auto_method(partitions.num_samples)
    if method is Method.AUTO and AutoEstimate.of(partitions.num_samples, partitions.num_heads, q_len).up_front:
        method = Method.MULTIPLICITY  # planning the per-sample path alone would take minutes (ops._engine.cost)
    if method is Method.AUTO:
        if partitions.num_samples > 1:  # one sample: nothing to estimate
            tiles = tilings(partitions, heads, q_len, route.causal)
        multiplicity_ns = float("inf") if tiles is None else sum(tiles[h][0] for h in heads)
        if multiplicity_ns <= AUTO_MARGIN * samples_floor(partitions.pitch, partitions.shift, q_len):
            method = Method.MULTIPLICITY  # the rule's choice whatever the per-sample plan: it is not built
        else:
            samples = samples_plan(partitions, num_kv_heads, q_len, route.causal)
            method = auto_method(partitions.num_samples, multiplicity_ns, samples_estimate(samples))
    kernel = route.kernel_of(method)
    if method is Method.SAMPLES:
        return Decision(method, kernel, backend_for(method, kernel), samples)
    prepared = None
    if tiles is not None and kernel is not Kernel.TRITON:  # the tiling the cost model estimated: the plan reuses it
        prepared = multiplicity_plan(partitions, heads, num_kv_heads, q_len, route.causal, tiles)
    return Decision(method, kernel, backend_for(method, kernel), prepared)


@dataclass(frozen=True)
class Plan(Generic[P]):
    """A call's work, host-side: the route, what :func:`decide` chose and the backend's own plan.

    Attributes:
        route: the call's :class:`Route`.
        method: the method, resolved.
        kernel: the kernel that runs the plan (the inputs are laid out for it: ``torch_attention.kernel_inputs``).
        partitions: the call's partitions.
        backend: the backend of :data:`BACKEND_TABLE` that runs it.
        backend_plan: that backend's plan (``P``: a ``SamplesPlan``, ``MultiplicityPlan`` or ``TritonPlan``).
    """

    route: Route
    method: Method
    kernel: Kernel
    partitions: Partitions
    backend: Backend[P]
    backend_plan: P


def plan(route: Route, partitions: Partitions, num_kv_heads: int, q_len: int, device: torch.device) -> Plan[Any]:
    """The plan of a call (host-side; reads the partition values): :func:`decide`, then the backend's plan (the
    one deciding built, where it did)."""
    d = decide(route, partitions, num_kv_heads, q_len)
    backend_plan = d.prepared
    if backend_plan is None:
        backend_plan = d.backend.plan(partitions, num_kv_heads, q_len, route.causal, device)
    return Plan(route, d.method, d.kernel, partitions, d.backend, backend_plan)
