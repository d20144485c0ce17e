"""The engine's names for kernels and methods: :class:`Kernel` and :class:`Method`.

Strings exist only at the public boundary (``backend=``, ``method=``: ``ops.options``) and in the CLI; inside the
engine a kernel is a :class:`Kernel` and a method a :class:`Method`. Both are ``str`` enums printed as their value,
so that a member is also its public spelling (``Kernel("flash") is Kernel.FLASH``, ``Kernel.FLASH == "flash"``).
Which one runs a call is decided in one place, ``ops._engine.routing``.
"""

from __future__ import annotations

import enum

__all__ = ["Kernel", "Method"]


class _Name(str, enum.Enum):
    """A ``str`` enum printed as its value (``enum.StrEnum`` of Python 3.11, on 3.10 too)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Kernel(_Name):
    """What runs a backend's attention calls.

    * ``FLASH`` (public ``backend="flash"``): torch's fused flash SDPA op of the device, a private ATen op
      (``_scaled_dot_product_flash_attention_for_cpu`` on the CPU, ``_scaled_dot_product_flash_attention`` on CUDA):
      on the CPU too, not only on GPUs;
    * ``MATH``: batched matmuls and a softmax (any device and dtype);
    * ``TRITON``: the Triton kernels of the multiplicity form;
    * ``CPU``: this package's own CPU kernel (``ops._engine.cpu``, built at first use): the multiplicity form and the
      exact biases, with the bias computed inside the loop. Not a public ``backend=`` name: ``backend="auto"`` takes
      it on the CPU where it builds (``PLSH_CPU_KERNEL``).
    """

    FLASH = "flash"
    MATH = "math"
    TRITON = "triton"
    CPU = "cpu"


class Method(_Name):
    """How the estimator is computed: per sampled block (``SAMPLES``), each (query, key) pair once with its
    multiplicity (``MULTIPLICITY``), or chosen per call by the cost model (``AUTO``)."""

    AUTO = "auto"
    SAMPLES = "samples"
    MULTIPLICITY = "multiplicity"
