import sys

# The shared helpers assert too: let pytest explain their failures as it does in test files.
# Only under pytest: the soak's child processes (python -m tests.soak.child) import this
# package too, and importing pytest there cost 0.15 CPU-s at each of their ~25 starts.
if "_pytest" in sys.modules:
    import pytest

    pytest.register_assert_rewrite("tests.helpers")
