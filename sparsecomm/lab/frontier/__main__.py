"""``python -m sparsecomm.lab.frontier``: the same as ``sparsecomm frontier``."""
import sys

from sparsecomm.lab.frontier.cli import main

sys.exit(main())
