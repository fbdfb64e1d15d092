import torch, tapegrad
torch.set_default_dtype(torch.float64)
EXPRS = ["c.sin()", "c.cos()", "c.exp()", "c.log()", "c.sqrt()", "c.tanh()", "c.sigmoid()",
 "c.relu()", "c.abs()", "-c", "c*2", "c/2", "2/c", "c**2", "c**3", "c*w", "w*c", "c/w", "w/c", "c+w", "c-w",
 "c.sum()", "c.mean()", "c.prod()", "c.clamp(0,1.5)", "c.square()", "c.reciprocal()", "c.softmax(0)",
 "c.log_softmax(0)", "c.reshape(2,1)", "c[0]", "c[1:]", "c.max()", "c.amax(0)", "c.norm()", "c.logsumexp(0)",
 "c@w", "tapegrad_or_torch.stack([c,w])", "tapegrad_or_torch.cat([c,w])", "c.exp().sum()", "c.clone()",
 "c.pow(w)", "w.pow(c)", "tapegrad_or_torch.maximum(c,w)", "tapegrad_or_torch.where(w>0,c,w)", "c.atan2(w)",
 "c.std()", "c.var()", "c.cumsum(0)", "c.sort()[0]", "c.t()", "c.unsqueeze(0)", "c.expand(3,2)", "c.log1p()",
 "c.expm1()", "c.erf()", "tapegrad_or_torch.nn.functional.softplus(c)", "c.min()", "c.outer(w)", "c.diag()", "c.dot(w)",
 "c.abs().sum()", "c.float()", "c.asin()", "c.atan()", "c.sinh()", "c.cosh()", "c.rsqrt()", "c.floor()", "c.sign()",
 "tapegrad_or_torch.nn.functional.mse_loss(c,w)", "c.trace() if c.ndim==2 else c.sum()"]
def run(M, e):
    x = M.tensor([0.3, 0.7], requires_grad=True)
    w = M.tensor([1.5, -0.5], requires_grad=True)
    c = x * 2
    try:
        d = eval(e, {"c": c, "w": w, "tapegrad_or_torch": M})
    except Exception as ex:
        return "forward " + type(ex).__name__
    c.add_(1.0)
    try:
        g = M.autograd.grad(d.sum(), [x, w], allow_unused=True)
        return "ok"
    except RuntimeError as ex:
        return "raised" if "inplace" in str(ex) else "other: " + str(ex)[:80]
def run_out(M, e):
    x = M.tensor([0.3, 0.7], requires_grad=True)
    w = M.tensor([1.5, -0.5], requires_grad=True)
    c = x * 2
    try:
        d = eval(e, {"c": c, "w": w, "tapegrad_or_torch": M})
        d.add_(1.0)
        y = d.sum()
    except Exception as ex:
        return "forward " + type(ex).__name__ + str(ex)[:50]
    try:
        g = M.autograd.grad(y, [x, w], allow_unused=True)
        return "ok"
    except RuntimeError as ex:
        return "raised" if "inplace" in str(ex) else "other: " + str(ex)[:80]
bad = []
for e in EXPRS:
    for f in (run, run_out):
        a, b = f(torch, e), f(tapegrad, e)
        if a != b: bad.append((f.__name__, e, a, b))
for b in bad: print(b)
print(len(bad), "of", 2*len(EXPRS))
