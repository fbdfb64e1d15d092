"""The ops registry, by family. Everything else (recorder, interpreters, tests, docs) derives
from it."""
from . import elementwise, arrays, traced  # noqa: F401  (opcodes: _registry.OPCODES)
from ._backends import (Node, Sym, build_backends, build_node_backend, call_rule, rule_inputs,
                        rule_of)
from ._registry import (ARRAY, ARRAY_OP, BINARY, BY_NAME, COMPARE, OPCODES, OPS, REPLAY, ROW,
                        SPECIAL, UNARY, UNARY_C,
                        Op, finish, opcode_enum)

finish()
Opcode = opcode_enum()
SymF, NpF = build_backends()
NodeF = build_node_backend()


def _rule_uses(op):
    """Names among a, b, out that an elementwise rule reads (from its generated source)."""
    import re
    grads = rule_of(op, SymF, Sym).values()
    text = " ".join(x.s if isinstance(x, Sym) else "" for x in grads)
    # constants count when the rule or the forward reads them (a replay runs the forward)
    fwd = (op.nb or "c0 c1").replace("{", "").replace("}", "")
    return frozenset([n for n in ("a", "b", "out") if re.search(rf"\b{n}\b", text)]
                     + [n for n in ("c0", "c1") if re.search(rf"\b{n}\b", text + " " + fwd)])


for _op in OPS:
    if _op.kind in (UNARY, UNARY_C, BINARY):
        _op.uses = _rule_uses(_op)
    elif _op.kind != SPECIAL:  # array, compare and replay ops: any constant may matter
        _op.uses = _op.uses | {"c0", "c1"}
del _op

__all__ = ["ARRAY", "ARRAY_OP", "BINARY", "BY_NAME", "COMPARE", "REPLAY", "OPS", "ROW", "SPECIAL",
           "UNARY", "UNARY_C", "const_ops", "Op", "Opcode", "Node", "NodeF", "Sym", "SymF", "NpF",
           "call_rule", "rule_inputs", "rule_of"]


def const_ops():
    """{binary op name: ((op, sign of c) for ``x op c``, (op, sign of c) for ``c op x``)}
    from the registry's ``const`` fields (the forms recorded for a float constant)."""
    return {op.name: ((BY_NAME[r], rs), (BY_NAME[lft], ls))
            for op in OPS if op.const is not None for (r, rs), (lft, ls) in (op.const,)}
