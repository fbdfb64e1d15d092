"""Shared pytest setup: the repository root on sys.path, and a ``torch`` fixture."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def torch():
    """torch, or a clean skip when it is not installed."""
    return pytest.importorskip("torch")
