import pytest

# The shared helpers assert too: let pytest explain their failures as it does in test files.
pytest.register_assert_rewrite("tests.helpers")
