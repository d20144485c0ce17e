"""Alias of :mod:`positional_lsh.lm.model` (the language model), kept for existing imports."""

import sys

from positional_lsh.lm import model as _model

sys.modules[__name__] = _model
