"""``python -m tests.soak``: run the chaos soak (``--help`` for its settings)."""

from __future__ import annotations

import sys

from tests.soak.main import main

sys.exit(main())
