"""Alias of :mod:`positional_lsh.integrations.hf` (the transformers integration), kept for existing imports."""

import sys

from positional_lsh.integrations import hf as _hf

sys.modules[__name__] = _hf
