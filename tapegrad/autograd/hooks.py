"""The reverse sweep with hooks: entry by entry in Python, calling tensor hooks, node
pre-hooks and node post-hooks where torch calls them ("Backward Hooks execution").

Any live hook makes ``grad`` and ``backward`` decline their compiled paths (one check of
``graph.HOOKS``); a backward whose graph holds a hook then runs ``sweep`` here. The rules
themselves are the ones every other path runs (``cpu.array_vjp``, and with create_graph
``rerecord.rule``, so what a hook returns is part of the recorded gradient).
"""
from __future__ import annotations

import contextlib

import numpy as np

from ..interpreters import cpu, rerecord
from ..ops import ARRAY, ARRAY_OP, OPS, NpF
from ..ops._registry import Part
from ..ops.arrays import sum_to
from ..tensor import _plain, _pyfloat, no_grad
from .graph import HOOKS, _NUMBER_EDGE, leaf_hooks, node_state

_NAMES = [op.name for op in OPS]


def graph_has_hooks(graph, ins, todo):
    """Whether a hook sits on what this backward sweeps: its entries ``todo`` (a bool per
    slot: needed, input or output, and reached) or leaves in ``ins``. Hooks elsewhere on
    the same tapes (a dead tensor's, kept until its tape goes) do not count."""
    if not HOOKS[0]:
        return False
    n = len(todo)

    def swept(t, k):
        s = graph.slot(t, k)
        return s < n and todo[s]
    for t in graph.tapes:
        per = t.hooks
        if per and any((st["pre"] or st["post"] or st["tensor"]) and swept(t, k)
                       for k, st in per.items()):
            return True
        for _, ks in t.leaf_items():
            if leaf_hooks(t.aux[ks[0]][0], "tensor") and any(swept(t, k) for k in ks):
                return True
    return bool(ins) and any(leaf_hooks(x, "tensor") for x in ins)


def _as_tensor(v, like):
    if v is None:
        v = 0.0 if like.__class__ is _pyfloat or np.ndim(like) == 0 and \
            np.asarray(like).dtype == np.float64 else np.zeros(np.shape(like),
                                                               np.asarray(like).dtype)
    if v.__class__ is float:
        return _plain(v)
    v = np.asarray(v)
    return _plain(float(v) if v.ndim == 0 and v.dtype == np.float64 else np.array(v))


def _value_of(t, like):
    """A hook's returned tensor as an adjoint shaped like ``like``."""
    from ..tensor import Tensor
    if not isinstance(t, Tensor):
        raise TypeError(f"a backward hook must return a Tensor or None, got {type(t).__name__}")
    d = t._d
    if like.__class__ is _pyfloat or np.ndim(like) == 0 and np.asarray(like).dtype.kind == "f" \
            and not isinstance(like, np.ndarray):
        return float(d)
    if np.shape(d) != np.shape(like):
        raise RuntimeError(f"hook returned a gradient of shape {list(np.shape(d))}, expected "
                           f"{list(np.shape(like))}: a hook may change a gradient's values, "
                           "not its shape")
    return np.array(d, dtype=np.asarray(like).dtype)


def _get(graph, adj, adjd, s):
    if graph.is_array(s):
        return adjd.get(s)
    return float(adj[s])


def _put(graph, adj, adjd, s, v):
    if graph.is_array(s):
        adjd[s] = v
    else:
        adj[s] = v


def _call_tensor_hooks(hooks, g, like):
    for fn in list(hooks.values()):
        r = fn(_as_tensor(g, like))
        if r is not None:
            _same_dtype(fn, r, like)
            g = _value_of(r, like)
    return g


def _same_dtype(fn, r, like):
    """torch refuses a tensor hook's result of another dtype (a node hook's is cast)."""
    from ..tensor import Tensor
    want = np.float64 if like.__class__ is _pyfloat else np.asarray(like).dtype
    if isinstance(r, Tensor) and r.dtype.np != want:
        raise RuntimeError(f"hook '{getattr(fn, '__name__', fn)}' has changed the type of "
                           f"value (was {np.dtype(want).name} got {np.dtype(r.dtype.np).name}):"
                           f" return the gradient in its own dtype (g.to(g.dtype))")


def sweep(graph, need, adj, adjd, is_input, is_output, reach, accumulate=None, direct=None,
          direct_leaves=None, rec=None):
    """``cpu.sweep`` with hooks, in torch's order: at each entry, last first, its tensor
    hooks on the incoming gradient (retain_grad then reads the result; a non-leaf input of
    ``grad`` is captured before them, as torch does), its pre-hooks, its rule, its
    post-hooks on the gradients it made; then each leaf it was the last user of, in input
    order: the leaf's tensor hooks on its whole gradient and, with ``accumulate`` (backward),
    the accumulation into ``.grad`` and the post-accumulate-grad hooks. ``direct`` holds the
    seeds of outputs that are leaves themselves (id -> seed): they join their leaf's total
    before its hooks, which torch calls once on the whole gradient (the entries left run
    through their hooks here). Returns the ids of the leaves ``accumulate`` took.

    With ``rec`` = (F, as_tensor, add) (create_graph) every adjoint is a recorded tensor in
    ``adjd`` and the rules are re-recorded (``rerecord.rule``), so what a hook returns (which
    may depend on the inputs) is part of the recorded gradient, as in torch."""
    value = graph.value
    if rec is None:
        def get(s):
            return _get(graph, adj, adjd, s)

        def put(s, v):
            _put(graph, adj, adjd, s, v)
        call_hooks = _call_tensor_hooks
    else:
        get, put, call_hooks = adjd.get, adjd.__setitem__, _call_tensor_hooks_rec
    todo = np.nonzero((need | is_input | is_output) & reach)[0][::-1].tolist()
    leaf_slots, slot_leaf, last_user = _leaf_users(graph, todo, need)
    captured = {}
    done = set()

    def leaf_ready(key):
        leaf, slots = leaf_slots[key]
        done.add(key)
        total = None
        for t in slots:
            v = get(t)
            if v is not None:
                total = v if total is None else total + v
        if direct and key in direct:  # the leaf is also an output: its seed joins the total
            d = direct.pop(key)
            total = d if total is None else total + d
        hooks = leaf_hooks(leaf, "tensor")
        if hooks:
            total = call_hooks(hooks, total, value(slots[0]))
        for t in slots:  # the total now sits in the first slot
            if rec is not None or graph.is_array(t):
                adjd.pop(t, None)
            else:
                adj[t] = 0.0
        if accumulate is not None:
            if total is not None:
                accumulate(leaf, total)
            return
        if total is not None:
            put(slots[0], total)

    taken = []
    # create_graph records the hooks' ops too (grad mode is on, as in torch)
    with no_grad() if rec is None else contextlib.nullcontext(), np.errstate(all="ignore"):
        _direct_leaf_hooks(direct, direct_leaves, leaf_slots, call_hooks)
        for s in todo:
            name = _NAMES[int(graph.rows[s, 0]) & ~ARRAY]
            if name in ("const", "leaf"):
                continue
            tape, k = graph.locate(s)
            st = node_state(tape, k, create=False)
            multi = name in cpu.MULTI_OUTPUT
            if st is not None and st["tensor"] and not multi:
                g0 = get(s)
                if is_input[s]:
                    captured[s] = g0
                g = call_hooks(st["tensor"], g0, value(s))
                if g is not None:
                    put(s, g)
            if not need[s]:
                continue  # an input of grad(), or an output nothing below it is wanted from
            if st is not None and st["pre"]:
                _pre_hooks(graph, adj, adjd, s, st["pre"], multi, tape, k, rec)
            if st is not None and st["post"]:
                _with_post_hooks(graph, adj, adjd, s, st["post"], multi, tape, k, name, rec)
            elif rec is None:
                cpu.array_vjp(graph, s, adj, adjd)
            else:
                _rule_rec(graph, s, adjd, rec)
            for i in _inputs(graph, s):
                key = slot_leaf.get(i)
                if key is not None and key not in done and last_user.get(key) == s:
                    leaf_ready(key)
                    if accumulate is not None:
                        taken.append(key)
        for key in list(leaf_slots):  # leaves no entry reads (an output that is a leaf)
            if key not in done:
                leaf_ready(key)
                if accumulate is not None:
                    taken.append(key)
    for s, g in captured.items():
        put(s, g)
    return set(taken)


def _leaf_users(graph, todo, need):
    """For the leaves among the slots ``todo`` sweeps: id(leaf) -> (leaf, its slots), slot
    -> id(leaf), and id(leaf) -> the last entry of the sweep that reads one of its slots
    (where the leaf's gradient is complete)."""
    leaf_slots = {}
    for s in todo:
        if _NAMES[int(graph.rows[s, 0]) & ~ARRAY] == "leaf":
            leaf = graph.aux(s)[0]
            leaf_slots.setdefault(id(leaf), (leaf, []))[1].append(s)
    slot_leaf = {s: key for key, (_, ss) in leaf_slots.items() for s in ss}
    last_user = {}
    for s in todo:
        if need[s]:
            for i in _inputs(graph, s):
                key = slot_leaf.get(i)
                if key is not None:
                    last_user[key] = s
    return leaf_slots, slot_leaf, last_user


def _direct_leaf_hooks(direct, direct_leaves, leaf_slots, call_hooks):
    """Leaf outputs no entry reads: their tensor hooks run first on their seeds, as in
    torch."""
    for key in list(direct or ()):
        if key not in leaf_slots:
            leaf = direct_leaves[key]
            hooks = leaf_hooks(leaf, "tensor")
            if hooks:
                direct[key] = call_hooks(hooks, direct[key], leaf._d)


def _call_tensor_hooks_rec(hooks, g, like):
    """``_call_tensor_hooks`` on recorded tensors: a hook's result is used as it is (with
    its history), so higher derivatives see what the hook did."""
    for fn in list(hooks.values()):
        r = fn(g if g is not None else _as_tensor(None, like))
        if r is not None:
            _same_dtype(fn, r, like)
            g = _checked_rec(r, like)
    return g


def _checked_rec(r, like):
    """A hook's returned tensor, checked as ``_value_of`` checks it, kept as it is."""
    from ..tensor import Tensor
    if not isinstance(r, Tensor):
        raise TypeError(f"a backward hook must return a Tensor or None, got {type(r).__name__}")
    if tuple(r.shape) != np.shape(like):
        raise RuntimeError(f"hook returned a gradient of shape {list(r.shape)}, expected "
                           f"{list(np.shape(like))}: a hook may change a gradient's values, "
                           "not its shape")
    return r


def _zeros_rec(graph, s):
    return _as_tensor(None, graph.value(s))


def _rule_rec(graph, s, adjd, rec, g=None):
    """Entry ``s``'s rule re-recorded on its adjoint, added into its inputs' adjoints."""
    F, as_tensor, add = rec
    if g is None:
        g = adjd.get(s)
        if g is None:
            return
    for x, gr in rerecord.rule(graph, s, g, F, as_tensor):
        rerecord.gather(graph, adjd, x, gr, F, add)


def _outputs(graph, adj, adjd, s, multi, tape, k, rec=None):
    """grad_outputs of entry ``s``, as tensors (recorded ones as they are, with ``rec``)."""
    if multi:
        parts = adjd.get(s) or {}
        metas = None
        n = tape.aux[k][3] if OPS[int(tape.code[k * 5]) & ~ARRAY].name == "function" else \
            (max(parts) + 1 if parts else 0)
        out = []
        for i in range(n):
            g = parts.get(i)
            out.append(None if g is None else g if rec is not None else _as_tensor(g, g))
        return tuple(out), metas
    if rec is not None:
        g = adjd.get(s)
        return (g if g is not None else _zeros_rec(graph, s),), None
    like = graph.value(s)
    return (_as_tensor(_get(graph, adj, adjd, s), like),), None


def _pre_hooks(graph, adj, adjd, s, hooks, multi, tape, k, rec=None):
    gos, _ = _outputs(graph, adj, adjd, s, multi, tape, k, rec)
    for fn in list(hooks.values()):
        r = fn(gos)
        if r is not None:
            gos = tuple(r)
    if multi:
        adjd[s] = {i: (g if rec is not None else g._d if g.__class__ is not float else g)
                   for i, g in enumerate(gos) if g is not None}
    elif rec is not None:
        adjd[s] = _checked_rec(gos[0], graph.value(s))
    else:
        _put(graph, adj, adjd, s, _value_of(gos[0], graph.value(s)))


def _inputs(graph, s, name=None):
    if OPS[int(graph.rows[s, 0]) & ~ARRAY].nary:
        return graph.nary_inputs(s)
    _, a, b, _, _ = graph.row(s)
    return [x for x in (a, b) if x >= 0]


def _rule_grads(graph, s, adj, adjd, multi):
    """(input slot, gradient) per argument of entry ``s``'s rule, one per argument even when
    an input appears twice (``x * x``), so post-hooks see torch's grad_inputs."""
    code, a, b, c0, c1 = graph.row(s)
    op = OPS[code & ~ARRAY]
    value = graph.value
    out = value(s)
    if multi:
        g = adjd.get(s)
    elif graph.is_array(s):
        g = adjd.get(s)
        if g is None:
            g = np.zeros_like(out)
    else:
        g = adj[s]
    if op.kind is ARRAY_OP:
        inputs = graph.nary_inputs(s) if op.nary else ((a,) if b < 0 else (a, b))
        grads = op.vjp(NpF, g, [value(x) for x in inputs], out, graph.aux(s))
    else:
        inputs, grads = cpu.elementwise_rule(op, NpF, g, out, a, b, c0, c1, value)
    res = []
    for x, gr in zip(inputs, grads):
        if gr is not None and gr.__class__ is cpu._THUNK:
            gr = gr()
        if gr is None or gr.__class__ is Part:
            res.append((x, gr))
            continue
        v = value(x)
        if graph.is_array(x):
            if gr.__class__ is not np.ndarray:
                gr = np.broadcast_to(np.asarray(gr, dtype=v.dtype), v.shape)
            elif gr.shape != v.shape:
                gr = sum_to(gr, v.shape)
            gr = np.asarray(gr, dtype=v.dtype)
        elif gr.__class__ is not float:
            gr = float(np.sum(gr))
        res.append((x, gr))
    return res


def _with_post_hooks(graph, adj, adjd, s, hooks, multi, tape, k, name, rec=None):
    """Run entry ``s``'s rule, let its post-hooks see (and replace) the gradients it made
    for each argument, then add them to the adjoints."""
    gos, _ = _outputs(graph, adj, adjd, s, multi, tape, k, rec)
    if rec is not None:
        g = adjd.get(s) if multi else gos[0]
        pairs = rerecord.rule(graph, s, g, rec[0], rec[1], every=True) if g is not None \
            else []
    else:
        pairs = _rule_grads(graph, s, adj, adjd, multi)
    gis = []
    for x, gr in pairs:
        if gr is None or gr.__class__ is Part or \
                _NAMES[int(graph.rows[x, 0]) & ~ARRAY] == "const":
            gis.append(None)
        else:
            gis.append(gr if rec is not None else _as_tensor(gr, graph.value(x)))
    if name in _NUMBER_EDGE:
        gis.append(None)
    gis = tuple(gis)
    for fn in list(hooks.values()):
        r = fn(gis, gos)
        if r is not None:
            r = tuple(r)
            if len(r) != len(gis):
                raise RuntimeError(f"hook returned {len(r)} gradients, expected {len(gis)} "
                                   f"(one per input of {name})")
            gis = r
    for (x, gr), g in zip(pairs, gis):
        if gr.__class__ is Part:  # a custom Function's output: passed on as made
            if rec is not None:
                rerecord.gather(graph, adjd, x, gr, rec[0], rec[2])
            else:
                cpu._gather(adjd, x, gr)
            continue
        if g is None:
            continue
        if rec is not None:
            g = _checked_rec(g, graph.value(x))
            rerecord.gather(graph, adjd, x, g, rec[0], rec[2])
            continue
        v = _value_of(g, graph.value(x))
        if graph.is_array(x):
            prev = adjd.get(x)
            adjd[x] = v if prev is None else prev + v
        else:
            adj[x] += v


def post_accumulate(x):
    """Run leaf ``x``'s post-accumulate-grad hooks (after ``backward`` filled ``x.grad``)."""
    hooks = leaf_hooks(x, "post")
    if hooks:
        with no_grad():
            for fn in list(hooks.values()):
                fn(x)


def leaf_output_hooks(x, total, batch=None):
    """The tensor hooks of leaf ``x`` when a backward's output is ``x`` itself: on a
    recorded seed (create_graph) recording, and with ``batch`` once per sample."""
    from ..tensor import Tensor
    hooks = leaf_hooks(x, "tensor")
    if not hooks:
        return total
    if batch:
        parts = [leaf_output_hooks(x, total[i]) for i in range(batch)]
        if isinstance(total, Tensor):
            from ..functions import stack
            return stack(parts)
        return np.stack([np.asarray(p) for p in parts])
    if isinstance(total, Tensor):
        return _call_tensor_hooks_rec(hooks, total, x._d)
    with no_grad():
        return _call_tensor_hooks(hooks, total, x._d)
