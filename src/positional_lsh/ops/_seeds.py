"""Per-layer generator seeds derived from one base seed (shared by the language model and the transformers swap)."""

from __future__ import annotations

__all__ = ["layer_seed"]


def layer_seed(seed: int, layer: int) -> int:
    """Independent-looking seeds per layer from one base seed: ``(seed * 1_000_003 + layer * 7_919 + 1) mod 2^62``.

    A fixed odd multiplier, kept below ``2**63`` (a valid ``torch.Generator`` seed). The shipped model's
    evaluation numbers depend on this exact formula (its eval-mode partitions are drawn from these seeds), so it
    must not change. Further keys (e.g. a training step) are folded in by nesting:
    ``layer_seed(layer_seed(seed, layer), step)``.

    Args:
        seed: base seed (int).
        layer: layer index (int).

    Returns:
        int in ``[0, 2**62)``.
    """
    return (int(seed) * 1_000_003 + int(layer) * 7_919 + 1) % (2**62)
