"""The engine of the estimator (private to the op layer): dispatch, plans, the backends, kernels and the one op.

Nothing outside :mod:`positional_lsh.ops` imports this package; the public entry points are
:func:`positional_lsh.plsh_attention` and :class:`positional_lsh.PositionalLSHAttention`. See
docs/architecture.md, "How a call flows".
"""
