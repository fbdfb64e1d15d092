"""Grad modes (thread-local, as torch's): no_grad, enable_grad, set_grad_enabled, inference_mode."""
from __future__ import annotations

import functools
import inspect

from ._dtypes import _pybool
from .tape import STATE, set_grad_mode


def is_grad_enabled():
    """Whether ops record onto the tape in this thread."""
    return STATE.grad_enabled


def is_inference_mode_enabled():
    return STATE.inference


class _GradMode:
    """Base for grad-mode context managers; each is also a function decorator (with or
    without parentheses, generators included)."""

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not isinstance(args[0], _pybool):
            return cls()(args[0])  # used as @decorator without parentheses
        return super().__new__(cls)

    def _enter_mode(self):
        raise NotImplementedError

    def __enter__(self):
        self._prev = (STATE.grad_enabled, STATE.inference)
        self._enter_mode()
        return self

    def __exit__(self, *exc):
        set_grad_mode(self._prev[0])
        STATE.inference = self._prev[1]
        return False

    def __call__(self, fn):
        make = self.clone
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def generator(*args, **kwargs):
                gen = fn(*args, **kwargs)
                with make():
                    value = next(gen)
                while True:
                    try:
                        sent = yield value
                    except GeneratorExit:
                        with make():
                            gen.close()
                        raise
                    except BaseException as e:  # noqa: BLE001  thrown into the generator
                        with make():
                            value = gen.throw(e)
                    else:
                        try:
                            with make():
                                value = gen.send(sent)
                        except StopIteration as stop:
                            return stop.value
            return generator

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with make():
                return fn(*args, **kwargs)
        return wrapper

    def _args(self):
        return ()

    def clone(self):
        return self.__class__(*self._args())


class no_grad(_GradMode):
    """Context manager / decorator: ops in it do not record."""

    def _enter_mode(self):
        set_grad_mode(False)


class enable_grad(_GradMode):
    """Context manager / decorator: ops in it record (inside ``no_grad`` too)."""

    def _enter_mode(self):
        set_grad_mode(True)


class set_grad_enabled(_GradMode):
    """Sets grad mode at once (as a function), or for a ``with`` block or a decorated
    function (decorating restores the mode it had before)."""

    def __new__(cls, mode):
        return object.__new__(cls)

    def __init__(self, mode):
        if not isinstance(mode, _pybool):
            raise TypeError(f"set_grad_enabled expects a bool, got {type(mode).__name__}")
        self.mode = mode
        self._prev = (STATE.grad_enabled, STATE.inference)
        set_grad_mode(mode)

    def _enter_mode(self):
        set_grad_mode(self.mode)

    def __enter__(self):
        return self

    def __call__(self, fn):
        set_grad_mode(self._prev[0])
        STATE.inference = self._prev[1]
        return super().__call__(fn)

    def clone(self):
        return _SetGradMode(self.mode)

    def _args(self):
        return (self.mode,)


class _SetGradMode(_GradMode):
    def __new__(cls, mode):
        return object.__new__(cls)

    def __init__(self, mode):
        self.mode = mode

    def _enter_mode(self):
        set_grad_mode(self.mode)


class inference_mode(_GradMode):
    """Like ``no_grad`` (tapegrad has no separate inference tensors)."""

    def __init__(self, mode=True):
        self.mode = mode

    def _enter_mode(self):
        if self.mode:
            set_grad_mode(False)
            STATE.inference = True

    def _args(self):
        return (self.mode,)
