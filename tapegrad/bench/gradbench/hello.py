"""hello: ``square`` (x * x) and ``double``, its derivative; the protocol smoke test."""
from ._common import check, as_float, grad, leaf, trace as _trace


def square(x):
    return x * x


def prepare(function, input, M, trace):
    check('hello', function, ('square', 'double'))
    if trace:
        prog = _trace(square, float(input))
        if function == "square":
            return (lambda: prog(float(input))), as_float
        return (lambda: prog.grad(float(input))), as_float
    if function == "square":
        x = leaf(M, input)
        return (lambda: square(x)), as_float

    def double():
        x = leaf(M, input)
        return grad(M, square(x), (x,))[0]
    return double, as_float
