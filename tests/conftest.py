from __future__ import annotations

import os
import sys
from pathlib import Path

# A process group that hangs fails its test after 15 minutes instead of holding CI until
# its own limit (runtime/tools/spawn.py; a rank that spins never meets gloo's timeout).
os.environ.setdefault("PIPECC_SPAWN_DEADLINE", "900")

# Let tests import their helper modules (tests/helpers.py, tests/torch_oracle.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))
