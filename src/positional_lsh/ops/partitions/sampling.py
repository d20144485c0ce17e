"""The one partition-sampling policy: fresh partitions every training step, fixed seeded partitions in eval.

Every owner of positional-LSH attention that draws its own partitions — :class:`~positional_lsh.PositionalLSHAttention`,
each layer of the language model (:class:`~positional_lsh.lm.TransformerLM`) and the transformers swap
(:mod:`positional_lsh.integrations.hf`) — draws them through a :class:`PartitionSampler`:

* **eval**: the partitions drawn from ``eval_seed``: the same on every call, device and process;
* **training**: step ``c`` draws from ``layer_seed(seed, c)``: fresh partitions at every step, reproducible from
  the seed and the step alone (a resumed run continues the sequence by restoring its step counter), identical on
  every rank of a distributed run; ``seed=None`` draws from torch's global RNG instead;
* **under ``torch.compile``** (``fullgraph=True`` included) the draw is the custom op
  ``positional_lsh::sample_partitions`` (:func:`sample_op`), which reads the step from an int64 tensor inside the
  op: eager and compiled calls draw the same partitions for the same step.

The owners differ only in the seeds they pass (a layer uses ``layer_seed(base, layer)``) and in who counts the
steps (a module per call, the transformers swap per model call).
Learned slopes change every step: :meth:`PartitionSampler.draw` takes ``slopes=`` values that replace the sampler's
for that draw (the same seeds; eager and compiled).
"""

from __future__ import annotations

import torch

from positional_lsh.ops.checks import SlopesLike, as_slopes, check_int, positive_int
from positional_lsh.ops.partitions.partition import Partitions, sample_partitions

__all__ = ["PartitionSampler", "layer_seed"]


def layer_seed(seed: int, key: int) -> int:
    """Independent-looking seeds from one base seed: ``(seed * 1_000_003 + key * 7_919 + 1) mod 2^62``.

    The one seed formula of the package: a layer's seeds are ``layer_seed(base, layer)``, a training step's
    ``layer_seed(layer_seed(base, layer), step)``. A fixed odd multiplier, kept below ``2**63`` (a valid
    ``torch.Generator`` seed). The shipped model's evaluation numbers depend on this exact formula (its eval-mode
    partitions are drawn from these seeds), so it must not change.

    Args:
        seed: base seed (int).
        key: layer index, step, or any further key (int).

    Returns:
        int in ``[0, 2**62)``.
    """
    return (int(seed) * 1_000_003 + int(key) * 7_919 + 1) % (2**62)


@torch.library.custom_op("positional_lsh::sample_partitions", mutates_args=())
def sample_op(
    step: torch.Tensor | None, seed: int | None, slopes: torch.Tensor, num_samples: int, scheme: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pitch, shift)`` float64 ``(T, H)`` drawn as :func:`~positional_lsh.sample_partitions` does, from a
    generator seeded with ``seed`` (``None``: torch's global RNG), or with ``layer_seed(seed, step)`` when the int64
    tensor ``step`` is given. Opaque to ``torch.compile``: the draw of compiled calls."""
    if seed is None:
        generator = None
    elif step is None:
        generator = seed
    else:
        generator = layer_seed(seed, int(step))
    parts = sample_partitions(1, slopes, num_samples, scheme=scheme, generator=generator)
    return parts.pitch.clone(), parts.shift.clone()


@sample_op.register_fake
def _(
    step: torch.Tensor | None, seed: int | None, slopes: torch.Tensor, num_samples: int, scheme: str
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_samples, slopes.shape[0])
    return torch.empty(shape, dtype=torch.float64), torch.empty(shape, dtype=torch.float64)


def _check_seed(name: str, seed: object, allow_none: bool) -> int | None:
    if seed is None and allow_none:
        return None
    return check_int(name, seed, minimum=0)


class PartitionSampler:
    """The sampling policy of one attention layer (module docstring): eval partitions from ``eval_seed``, training
    step ``c`` from ``layer_seed(seed, c)`` (or torch's global RNG when ``seed`` is ``None``).

    Args:
        num_heads: number of query heads ``H``.
        slopes: ALiBi slopes ``(H,)`` or one float (default: the standard schedule); kept as float64 on the CPU.
        num_samples: ``T``, partitions per head.
        scheme: a registered scheme name (``positional_lsh.ops.partitions.schemes``).
        seed: base seed of the training draws, an int ``>= 0``, or ``None`` for torch's global RNG.
        eval_seed: seed of the eval partitions, an int ``>= 0``.

    Partitions do not depend on the length (pitches and shifts only), so each is drawn once per step (eval: once)
    and reused at every length with :meth:`Partitions.with_seq_len`.
    """

    def __init__(
        self,
        num_heads: int,
        slopes: SlopesLike = None,
        *,
        num_samples: int = 8,
        scheme: str = "discrete",
        seed: int | None = None,
        eval_seed: int = 0,
    ) -> None:
        self.num_heads = positive_int("num_heads", num_heads)
        self.slopes = as_slopes(slopes, self.num_heads)
        self.num_samples = positive_int("num_samples", num_samples)
        if not isinstance(scheme, str):
            raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
        sample_partitions(1, self.slopes, 1, scheme=scheme, generator=0)  # validates the scheme now
        self.scheme = scheme
        self.seed = _check_seed("seed", seed, allow_none=True)
        self.eval_seed = check_int("eval_seed", eval_seed, minimum=0)
        self._eval: Partitions | None = None
        self._train: tuple[int, Partitions] | None = None

    def __repr__(self) -> str:
        return (
            f"PartitionSampler(num_heads={self.num_heads}, num_samples={self.num_samples}, scheme={self.scheme!r}, "
            f"seed={self.seed}, eval_seed={self.eval_seed})"
        )

    def draw(
        self,
        seq_len: int,
        *,
        training: bool = False,
        step: int | torch.Tensor = 0,
        slopes: SlopesLike = None,
    ) -> Partitions:
        """The partitions for ``seq_len`` keys: eval mode's, or training step ``step``'s (an int or an int64
        tensor; read inside the draw op under ``torch.compile``).

        ``slopes``: ``None`` (the sampler's slopes), or ``(H,)`` values that replace them for this draw — learned
        slopes, which change every step (read detached; the same seeds, so the same uniforms, as with the sampler's
        slopes). Eager draws are cached per seed *and* slope values; compiled draws pass them to the draw op.
        """
        if torch.compiler.is_compiling():
            return self._compiled_draw(seq_len, training, step, slopes)
        seq_len = positive_int("seq_len", seq_len)
        values = self.slopes if slopes is None else as_slopes(slopes, self.num_heads)
        if not training:
            if self._eval is None or not torch.equal(self._eval.slopes, values):
                self._eval = self._sample(self.eval_seed, values)
            return self._eval.with_seq_len(seq_len)
        if self.seed is None:
            return self._sample(None, values).with_seq_len(seq_len)  # torch's global RNG: never cached
        c = check_int("step", int(step) if isinstance(step, torch.Tensor) else step, minimum=0)
        if self._train is None or self._train[0] != c or not torch.equal(self._train[1].slopes, values):
            self._train = (c, self._sample(layer_seed(self.seed, c), values))
        return self._train[1].with_seq_len(seq_len)

    def _sample(self, seed: int | None, slopes: torch.Tensor) -> Partitions:
        return sample_partitions(1, slopes, self.num_samples, scheme=self.scheme, generator=seed)

    def _compiled_draw(self, seq_len: int, training: bool, step: int | torch.Tensor, slopes: SlopesLike) -> Partitions:
        values = self.slopes if slopes is None else as_slopes(slopes, self.num_heads, read=False)
        if not training:
            pitch, shift = sample_op(None, self.eval_seed, values, self.num_samples, self.scheme)
        elif self.seed is None:
            pitch, shift = sample_op(None, None, values, self.num_samples, self.scheme)
        else:
            step_t = step if isinstance(step, torch.Tensor) else torch.tensor(step, dtype=torch.long)
            pitch, shift = sample_op(step_t, self.seed, values, self.num_samples, self.scheme)
        return Partitions(seq_len, values, pitch, shift, self.scheme)
