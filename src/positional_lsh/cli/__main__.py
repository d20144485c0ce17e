"""``python -m positional_lsh.cli COMMAND ...`` is ``plsh COMMAND ...`` (also under ``torchrun -m``)."""

import sys

from positional_lsh.cli import main

sys.exit(main())
