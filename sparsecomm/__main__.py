import sys

from sparsecomm.cli import main

sys.exit(main())
