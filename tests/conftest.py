from __future__ import annotations

import sys
from pathlib import Path

# Let tests import their helper modules (tests/helpers.py, tests/torch_oracle.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
