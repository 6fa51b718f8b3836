"""``python -m sparsecomm.lab.scaling``: the same as ``sparsecomm scale``."""
import sys

from sparsecomm.lab.scaling.cli import main

sys.exit(main())
