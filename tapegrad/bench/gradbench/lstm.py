"""lstm: ADBench's LSTM with diagonal weights; the loss is minus the mean log-likelihood of
each next character, the log-normalizer being log(sum(exp(y)) + 2) as in the reference."""
import numpy as np

from ._common import check, T, as_float, host, leaf, trace as _trace


def objective(M, main, extra, state, seq):
    """``main`` (2 layers x 4b: weight rows and bias rows of forget, in, out, change),
    ``extra`` (3 x b: input weight, output weight, output bias), ``state`` (2 layers x b:
    hidden, cell), ``seq`` (c x b)."""
    layers = main.shape[0] // 2
    b = seq.shape[1]
    hidden = [state[2 * i] for i in range(layers)]
    cell = [state[2 * i + 1] for i in range(layers)]
    W = [[main[2 * i][g * b:(g + 1) * b] for g in range(4)] for i in range(layers)]
    B = [[main[2 * i + 1][g * b:(g + 1) * b] for g in range(4)] for i in range(layers)]
    total = 0.0
    for t in range(seq.shape[0] - 1):
        inp = seq[t] * extra[0]
        for i in range(layers):
            forget = M.sigmoid(inp * W[i][0] + B[i][0])
            ingate = M.sigmoid(hidden[i] * W[i][1] + B[i][1])
            outgate = M.sigmoid(inp * W[i][2] + B[i][2])
            change = M.tanh(hidden[i] * W[i][3] + B[i][3])
            cell[i] = cell[i] * forget + ingate * change
            hidden[i] = outgate * M.tanh(cell[i])
            inp = hidden[i]
        ypred = inp * extra[1] + extra[2]
        lse = M.log(M.sum(M.exp(ypred)) + 2)
        total = total + M.sum(seq[t + 1] * (ypred - lse))
    return -total / ((seq.shape[0] - 1) * b)


def _post_grad(gs):
    return np.concatenate([host(g).reshape(-1) for g in gs]).tolist()


def prepare(function, input, M, trace):
    check('lstm', function, ('objective', 'jacobian'))
    main0, extra0 = (np.asarray(input[k], dtype=np.float64) for k in ("main_params",
                                                                      "extra_params"))
    state0, seq0 = (np.asarray(input[k], dtype=np.float64) for k in ("state", "sequence"))
    if trace:
        import tapegrad
        st, sq = T(tapegrad, state0), T(tapegrad, seq0)
        prog = _trace(lambda a, e: objective(tapegrad, a, e, st, sq), main0, extra0)
        if function == "objective":
            return (lambda: prog(main0, extra0)), as_float
        return (lambda: prog.grad(main0, extra0)), _post_grad
    st, sq = T(M, state0), T(M, seq0)
    if function == "objective":
        a, e = T(M, main0), T(M, extra0)
        return (lambda: objective(M, a, e, st, sq)), as_float

    def jacobian():
        a, e = leaf(M, main0), leaf(M, extra0)
        return M.autograd.grad(objective(M, a, e, st, sq), (a, e))
    return jacobian, _post_grad
