"""The ops registry, by family. Everything else (recorder, interpreters, tests, docs) derives from it."""
from . import elementwise, arrays  # noqa: F401  (registration order fixes the opcodes)
from ._backends import Sym, build_backends
from ._registry import (ARRAY, ARRAY_OP, BINARY, BY_NAME, OPS, ROW, SPECIAL, UNARY, UNARY_C,
                        Op, opcode_enum)

Opcode = opcode_enum()
SymF, NpF = build_backends()

__all__ = ["ARRAY", "ARRAY_OP", "BINARY", "BY_NAME", "OPS", "ROW", "SPECIAL", "UNARY",
           "UNARY_C", "Op", "Opcode", "Sym", "SymF", "NpF"]
