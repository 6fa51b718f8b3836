"""``python -m sparsecomm.lab.tolerance``: the same as ``sparsecomm check``."""
import sys

from sparsecomm.lab.tolerance.cli import main

sys.exit(main())
