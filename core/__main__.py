"""``python -m draftforge``: the same as the ``draftforge`` command."""

import sys

from draftforge.cli import main

sys.exit(main())
