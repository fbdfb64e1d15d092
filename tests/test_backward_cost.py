"""The fixed cost of one eager backward (issue 18): the work each backward does once
(rows, marks, seeds, release) is done once and keeps every check it guards."""
import numpy as np
import pytest

import tapegrad as tg
import tapegrad.tape as tape_mod
from tapegrad.interpreters import cpu


def _big_graph():
    """A general-path graph whose saved arrays are released by a backward (above
    ``_RELEASE_BYTES``), and its leaf."""
    x = tg.tensor(np.linspace(0.1, 1.0, 600), requires_grad=True)
    y = (tg.exp(x) * x).sum()
    return x, y


def test_release_reuses_the_converted_rows_and_drops_them(monkeypatch):
    """free_entries hands the sweep's rows to the release (not converted again) and the
    tape keeps no converted rows afterwards."""
    x, y = _big_graph()
    tape = y._tape
    calls = []
    real = cpu._release
    monkeypatch.setattr(cpu, "_release",
                        lambda t, f, rows=None: calls.append(rows) or real(t, f, rows))
    (g,) = tg.autograd.grad(y, x)
    np.testing.assert_allclose(g.numpy(), np.exp(x.detach().numpy()) * (1 + x.detach().numpy()))
    assert calls and calls[0] is not None
    assert tape._cache is None and tape._vcache is None
    # the saved arrays are gone: a second backward raises torch's error
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        tg.autograd.grad(y, x)


def test_release_without_rows_converts_and_drops_them():
    x, y = _big_graph()
    tape = y._tape
    need = np.ones(len(tape.vals), dtype=np.bool_)
    tape.freed = need.copy()
    cpu._release(tape, tape.freed)
    assert tape._cache is None
    tape_mod.end_tape(tape)


def _array_graph():
    x = tg.tensor(np.linspace(0.1, 1.0, 12).reshape(3, 4), requires_grad=True)
    return x, (tg.exp(x) * x).sum()


def test_array_sweep_converts_no_scalar_values():
    """A sweep of array entries only never reads the scalar values: the graph converts
    them on first use, so such a backward does not convert them at all."""
    x, y = _array_graph()
    tape = y._tape
    with tg.autograd.paths.force("sweep"):
        (g,) = tg.autograd.grad(y, x, retain_graph=True)
    xd = x.detach().numpy()
    np.testing.assert_allclose(g.numpy(), np.exp(xd) * (1 + xd))
    assert tape._vcache is None


def test_graph_values_are_the_first_n_of_a_grown_tape():
    x, y = _array_graph()
    tape = y._tape
    z = y * 2.0 + 1.0  # scalar entries: the compiled sweep reads the values
    graph = cpu.Graph([tape])
    n = graph.n
    w = z * 3.0  # the tape grows after the graph was built (as create_graph records)
    assert len(tape.vals) > n
    assert len(graph.vals) == n
    np.testing.assert_array_equal(graph.vals, tape.values()[:n])
    with tg.autograd.paths.force("sweep"):
        (g,) = tg.autograd.grad(w, x)
    xd = x.detach().numpy()
    np.testing.assert_allclose(g.numpy(), 6.0 * np.exp(xd) * (1 + xd))
