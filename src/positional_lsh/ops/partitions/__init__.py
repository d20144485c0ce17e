"""Partitions and their laws: ALiBi slopes, the scheme registry, decays, the sampling policy and the one definition
of a block (``block_bounds``).

A partition of ``0..n-1`` into contiguous blocks is given per head by a pitch ``p`` and a shift ``s``: position
``i`` is in block ``floor((i - s) / p)``. :func:`sample_partitions` draws ``T`` of them per head so that the mean
mask is ALiBi's ``exp(-m |i - j|)``; :class:`Partitions` holds them (``O(T * H)`` numbers).
"""
