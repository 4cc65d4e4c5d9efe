"""``python -m recoverssm ...``: the same command line as the ``recoverssm`` script."""
import sys

from recoverssm.cli import main

sys.exit(main())
