"""``python -m runlane.cli``: the ``runlane`` command."""

import sys

from runlane.cli import main

sys.exit(main())
