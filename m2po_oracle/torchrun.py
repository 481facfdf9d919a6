"""``python -m m2po_oracle.torchrun``: kept at this name for torchrun command lines; the
runner lives in :mod:`m2po_oracle.distributed.torchrun`."""

import sys

from m2po_oracle.distributed.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
