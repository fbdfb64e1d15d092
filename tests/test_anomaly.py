"""Anomaly mode: a NaN/inf made by the backward sweep names the op and the line that
recorded it; off, nothing is checked and nothing is slower."""
import warnings

import numpy as np
import pytest

import tapegrad as tg

torch = pytest.importorskip("torch")


def test_nan_in_backward_names_the_op_and_the_recording_line():
    x = tg.tensor([0.0, 1.0], requires_grad=True)
    with pytest.warns(UserWarning, match="Anomaly Detection has been enabled"):
        with tg.autograd.detect_anomaly():
            y = tg.sqrt(x) * 0.0  # THE-RECORDING-LINE
            with pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan") as e:
                y.sum().backward()
    assert "THE-RECORDING-LINE" in str(e.value)
    assert "test_anomaly.py" in str(e.value)
    # torch raises the same error type for the same program
    xt = torch.tensor([0.0, 1.0], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly():
            with pytest.raises(RuntimeError, match="SqrtBackward0"):
                (torch.sqrt(xt) * 0.0).sum().backward()


def test_scalar_path_and_inf_are_checked_too():
    s = tg.tensor(0.0, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.autograd.detect_anomaly():
            y = tg.log(s) + s
            with pytest.raises(RuntimeError, match="LogBackward0"):
                tg.autograd.grad(y, s)


def test_modes_and_results_outside_anomaly_mode():
    assert not tg.autograd.is_anomaly_enabled()
    with tg.autograd.set_detect_anomaly(True, check_nan=False):
        assert tg.autograd.is_anomaly_enabled()
        assert not tg.autograd.is_anomaly_check_nan_enabled()
        s = tg.tensor(0.0, requires_grad=True)
        assert np.isnan(tg.autograd.grad(tg.log(s) * 0.0, s)[0].item())
    assert not tg.autograd.is_anomaly_enabled()
    s = tg.tensor(0.0, requires_grad=True)
    assert np.isnan(tg.autograd.grad(tg.log(s) * 0.0, s)[0].item())


def test_anomaly_mode_gives_the_same_gradients():
    x = tg.tensor([0.5, 1.5, -2.0], requires_grad=True)

    def f():
        return (tg.exp(x) * tg.sin(x)).sum() + x[1] ** 3
    ref = tg.autograd.grad(f(), x)[0].numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tg.autograd.detect_anomaly():
            got = tg.autograd.grad(f(), x)[0].numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-15)
