import os
import sys

# Make `tests.distributed` importable as `distributed` from spawned workers too.
sys.path.insert(0, os.path.dirname(__file__))
