"""Shared pytest setup: the repository root on sys.path, the CUDA simulator, and a ``torch``
fixture."""
import os
import sys

# The CUDA target's tests run in numba's CUDA simulator unless asked otherwise
# (NUMBA_ENABLE_CUDASIM=0 on a machine with a GPU). numba reads this once, on import.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_addoption(parser, pluginmanager):
    """Without pytest-xdist (an environment older than the test extra, or ``-p no:xdist``),
    pyproject's ``-n 2`` is accepted and the tests run in one process, after one warning."""
    if not pluginmanager.hasplugin("xdist"):
        # xdist's own spelling of the option (pytest reserves lowercase short options)
        parser.getgroup("xdist")._addoption("-n", "--numprocesses", dest="numprocesses",
                                            default=None, help="needs pytest-xdist")


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and \
            not config.pluginmanager.hasplugin("xdist"):
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"-n {config.option.numprocesses} ignored: pytest-xdist is not installed (pip "
            "install -e '.[test]'); the tests run in one process"), stacklevel=2)


@pytest.fixture
def torch():
    """torch, or a clean skip when it is not installed."""
    return pytest.importorskip("torch")


def set_rollover(monkeypatch, n):
    """Make tapes roll over every ``n`` entries for one test (tests import this helper)."""
    import tapegrad.tape as tape_mod
    monkeypatch.setattr(tape_mod, "ROLLOVER", n)
    # tapes read the limit when they are made: start this thread on a new one
    monkeypatch.setattr(tape_mod.STATE, "tape", tape_mod._no_tape)


@pytest.fixture(scope="module")
def frozen_heap():
    """Tests that call ``gc.collect()`` (memory and hook counts) pay for it only on what they
    make: by their module's turn the session's heap (Numba's compiled functions, torch,
    hypothesis) is millions of objects that a full collection walks in seconds, so it moves
    to the permanent generation first (``gc.freeze``), and back after the module."""
    import gc
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
