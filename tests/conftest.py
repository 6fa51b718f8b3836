import os
import sys

# Spawned rank processes import test modules by name; keep tests/ importable there too.
sys.path.insert(0, os.path.dirname(__file__))
