from __future__ import annotations

import os
import sys

# the float64 reference lives beside the tests
sys.path.insert(0, os.path.dirname(__file__))
