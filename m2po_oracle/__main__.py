"""``python -m m2po_oracle``: the ``m2po-oracle`` command."""

import sys

from m2po_oracle.cli import main

sys.exit(main())
