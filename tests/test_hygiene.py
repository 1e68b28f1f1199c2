"""The suite's own hygiene: it runs in a temporary directory (working directory, HOME, the model
cache) and leaves the checkout as it found it. Ordered after every other test (conftest.py)."""

import os
from pathlib import Path

import pytest

from conftest import CHECKOUT_AT_START, ROOT, WORK, checkout_state


def test_the_suite_runs_in_a_temporary_directory():
    assert Path.cwd().resolve().is_relative_to(WORK.resolve())
    assert not WORK.resolve().is_relative_to(ROOT)
    for var in ("HOME", "M2FLOW_CACHE_DIR", "XDG_CACHE_HOME"):
        assert Path(os.environ[var]).resolve().is_relative_to(WORK.resolve()), var


def test_the_checkout_is_left_as_it_was():
    """``git status --ignored`` of the checkout now equals its state when the suite started:
    no test wrote runs/, .m2flow/, caches or bytecode into it."""
    if CHECKOUT_AT_START is None:
        pytest.skip("not a git checkout")
    assert checkout_state() == CHECKOUT_AT_START
