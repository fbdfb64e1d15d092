"""tapegrad as a drop-in for torch.autograd: printed forms, tensor functions, nn.functional,
custom Function edge cases, graph nodes and hooks, each against torch."""
import numpy as np
import pytest

import tapegrad

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _torch_float64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # tapegrad's default dtype
    yield
    torch.set_default_dtype(prev)


def _same_repr(tg, th):
    assert repr(tg) == repr(th).replace("torch.", "tapegrad."), (repr(tg), repr(th))


# -- what users see printed -------------------------------------------------------------------

NODE_EXPRS = [
    "x+2", "2+x", "x-2", "2-x", "x*2", "x/2", "2/x", "x**2", "2**x", "x+x", "x.sum()",
    "x.sum(0)", "x.mean()", "m.mean(0)", "m.view(6)", "m.reshape(6)", "m[:1].squeeze()",
    "m[:1].squeeze(0)", "x.unsqueeze(0)", "m.flatten()", "(x*1)[1]", "(x*1)[1:]",
    "(x*1)[[0,1]]", "m.T", "m.t()", "m.transpose(0,1)", "m.permute(1,0)", "x.expand(2,3)",
    "x.clone()", "x.float()", "M.stack([x,x])", "M.cat([x,x])", "m@x", "m@m.T", "x@x",
    "x.max()", "x.amax(0)", "x.max(0)[0]", "x.min()", "x.norm()", "x.logsumexp(0)",
    "x.softmax(0)", "x.log_softmax(0)", "M.where(x>1,x,0.)", "x.clamp(0,1)",
    "x.clamp(min=0)", "x.prod()", "x.prod(0)", "x.relu()", "M.outer(x,x)", "M.diag(x)", "-x",
    "x.sigmoid()", "M.maximum(x,x)", "M.atan2(x,x)", "x.square()", "x.reciprocal()",
    "x.abs()", "x**x", "x-x", "x/x", "x.exp()", "M.clamp_min(x, M.zeros(3))",
    "M.tensor(2.0, requires_grad=True) * 3", "M.tensor(2.0, requires_grad=True) - 3"]


@pytest.mark.parametrize("expr", NODE_EXPRS)
def test_grad_fn_names(expr):
    names, reprs = [], []
    for M in (torch, tapegrad):
        x = M.tensor([1.0, 2.0, 3.0], requires_grad=True)
        m = M.ones(2, 3, requires_grad=True)
        y = eval(expr, {"M": M, "x": x, "m": m})
        names.append(y.grad_fn.name())
        reprs.append(repr(y).replace("torch.", "tapegrad."))
    assert names[0] == names[1]
    assert reprs[0] == reprs[1]


class _Twice:
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_custom_function_node_name():
    outs = []
    for M in (torch, tapegrad):
        Twice = type("Twice", (M.autograd.Function,), dict(vars(_Twice)))
        y = Twice.apply(M.tensor([1.0, 2.0], requires_grad=True))
        outs.append((repr(y).replace("torch.", "tapegrad."), y.grad_fn.name(),
                     type(y.grad_fn).__name__ if M is torch else y.grad_fn.name()))
    assert outs[0] == outs[1] == outs[0][:1] + ("TwiceBackward", "TwiceBackward")
    assert outs[0][0] == "tensor([2., 4.], grad_fn=<TwiceBackward>)"


VALUES = [2.145, [2.5, 5.0], [1.0, 2.0], [1e-5, 1.0], [1e9, 1.0], [0.0, -0.0],
          [float("nan"), 1.5, float("inf")], [[1.0, -2.25], [3.5, 4.0]], [[[1.0]]], [],
          [-1.0, 1e-3, 123.456], list(np.linspace(-3, 3, 1500)), [[0.1] * 40] * 3, 1e-9,
          -3.0, [1e-4, 1e-3]]


@pytest.mark.parametrize("value", VALUES, ids=[str(i) for i in range(len(VALUES))])
def test_tensor_repr_like_torch(value):
    _same_repr(tapegrad.tensor(value), torch.tensor(value))
    _same_repr(tapegrad.tensor(value, requires_grad=True), torch.tensor(value,
                                                                        requires_grad=True))
    _same_repr(tapegrad.tensor(value, dtype=tapegrad.float32),
               torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("value", [[True, False], True, [[True], [False]], [1, -20, 3], 7,
                                   [], [[1, 2], [3, 4]]])
def test_bool_and_int_repr_like_torch(value):
    _same_repr(tapegrad.tensor(value), torch.tensor(value))
    _same_repr(tapegrad.tensor(value, dtype=tapegrad.int32),
               torch.tensor(value, dtype=torch.int32))


def test_empty_shapes_repr_like_torch():
    for shape in [(0,), (2, 0), (0, 3)]:
        _same_repr(tapegrad.zeros(*shape), torch.zeros(*shape))
        _same_repr(tapegrad.zeros(*shape, dtype=tapegrad.int64),
                   torch.zeros(*shape, dtype=torch.int64))


def test_size_is_a_tuple_that_prints_like_torch():
    s = tapegrad.zeros(4, 2).shape
    assert repr(s) == "tapegrad.Size([4, 2])" == repr(torch.zeros(4, 2).shape).replace(
        "torch", "tapegrad")
    assert str(s) == repr(s)
    assert isinstance(s, tuple) and s == (4, 2) and s[0] == 4 and len(s) == 2
    assert isinstance(s[1:], tapegrad.Size) and s[1:] == (2,)
    assert s.numel() == 8 == torch.zeros(4, 2).shape.numel()
    assert tapegrad.tensor(1.0).shape == () and repr(tapegrad.tensor(1.0).shape) == \
        "tapegrad.Size([])"
    assert tapegrad.zeros(4, 2).size() == s and tapegrad.zeros(3).size(0) == 3
    a, b = s
    assert (a, b) == (4, 2)
