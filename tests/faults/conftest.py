"""Fault-injection suites: crash matrix (real processes) and I/O errors (in-process)."""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.join(os.path.dirname(_HERE), "e2e")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
