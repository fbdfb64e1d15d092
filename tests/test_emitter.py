"""The fast array paths, the one rule-calling convention and the generated sweeps: each
checked against torch or against the general sweep."""
import numpy as np
import pytest

import tapegrad
import tapegrad.tape
from tapegrad.autograd import paths

torch = pytest.importorskip("torch")


def _two(x):
    return ((x * 2.0).tanh() * x.cos() + x.sqrt()).sum() * 0.5


def test_array_import_is_swept(monkeypatch):
    """A tape that rolled over imports an array from the tape before it (opcode with the
    ARRAY bit): the flat path counted only scalar imports, so it swept past the import and
    gave the gradient of ``sqrt`` alone (and so did a 1e6-element loss by default)."""
    monkeypatch.setattr(tapegrad.tape, "MAX_BYTES", 3200)  # rolls over after x * 2.0 ... mul
    x0 = np.linspace(0.1, 0.9, 100)
    xt = torch.tensor(x0, requires_grad=True)
    (ref,) = torch.autograd.grad(_two(xt), (xt,))
    x = tapegrad.tensor(x0, requires_grad=True)
    y = _two(x)
    assert y._tape.imports, "the loss's tape should import an array"
    (g,) = tapegrad.autograd.grad(y, (x,))
    np.testing.assert_allclose(g.numpy(), ref.numpy(), rtol=1e-13, atol=1e-15)
    with paths.force("flat"), pytest.raises(paths.PathDeclined):
        tapegrad.autograd.grad(_two(x), (x,))
