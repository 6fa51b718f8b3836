"""``python -m sparsecomm.lab.costmodel``: the same as ``sparsecomm project``."""
import sys

from sparsecomm.lab.costmodel.cli import main

sys.exit(main())
