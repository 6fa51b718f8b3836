import sys

from sparsecomm.lab.cli import main

sys.exit(main())
