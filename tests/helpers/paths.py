"""Where things are: the repository, its examples, the test data and the test scripts."""

from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
SCRIPTS = os.path.join(TESTS, "scripts")
EXAMPLES = os.path.join(ROOT, "examples")
SAMPLES = os.path.join(ROOT, "samples")
