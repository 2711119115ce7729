"""The C kernels' ABI is written once, in kernels/csrc/kvpilot_kernels.h: every .c file includes it
(so the compiler checks each definition against it), and these tests check the other side, the
ctypes declarations in kernels/*.py, against it: every declared function's name, argument count and
types, and return type; the fields of the structs kvpilot_decoder_stack takes; and that every symbol
a built library exports is declared in the header."""

from __future__ import annotations

import ctypes
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.kernels import cbuild, cpu_attention, cpu_decoder, cpu_moe, cpu_ops, qlinear
from tests.needs import missing, require_tool

CSRC = Path(cbuild.__file__).parent / "csrc"
HEADER = CSRC / "kvpilot_kernels.h"
# every C extension the kernels build (a new one joins this list and the header)
EXTENSIONS = {
    "cpu_ops.c": cpu_ops.EXTENSION,
    "paged_attention_cpu.c": cpu_attention.EXTENSION,
    "decoder_cpu.c": cpu_decoder.EXTENSION,
    "moe_cpu.c": cpu_moe.EXTENSION,
    "qmatmul_cpu.c": qlinear.EXTENSION,
    "qgemm_cpu.c": qlinear.GEMM_EXTENSION,
}
STRUCTS = {"kv_linear": cpu_decoder.Linear, "kv_layer": cpu_decoder.Layer, "kv_step": cpu_decoder.Step}
_SCALARS: dict[str, Any] = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float}


@dataclass(frozen=True)
class CType:
    """One C type as the header spells it: a base name (`const` dropped), pointer depth, array length."""

    base: str
    pointers: int = 0
    array: int | None = None
    function_pointer: bool = False

    def matches(self, ct: Any) -> bool:
        """Whether the ctypes type `ct` passes or holds a value of this C type."""
        if self.array is not None:
            inner = CType(self.base, self.pointers)
            return getattr(ct, "_length_", None) == self.array and inner.matches(ct._type_)
        if self.function_pointer:
            return ct is ctypes.c_void_p
        if self.pointers == 0:
            if self.base == "void":
                return ct is None
            if self.base in STRUCTS:
                return ct is STRUCTS[self.base]
            return ct is _SCALARS[self.base]
        if self.pointers == 1 and self.base == "char":
            return ct is ctypes.c_char_p
        if ct is ctypes.c_void_p:  # any data pointer travels as an address
            return True
        target = getattr(ct, "_type_", None)
        return (
            self.pointers == 1
            and self.base in STRUCTS
            and isinstance(target, type)
            and target is STRUCTS[self.base]
        )


@dataclass(frozen=True)
class Function:
    name: str
    restype: CType
    args: tuple[CType, ...]


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def _ctype(decl: str) -> tuple[CType, str]:
    """'const uint16_t *const *m13' -> (CType('uint16_t', 2), 'm13'); the name may be absent."""
    decl = " ".join(decl.split())
    typeof = re.fullmatch(r"__typeof__\((\w+)\)\s*\*\s*(\w+)", decl)
    if typeof:
        return CType(typeof.group(1), function_pointer=True), typeof.group(2)
    array = re.search(r"\[(\d+)\]$", decl)
    if array:
        decl = decl[: array.start()]
    pointers = decl.count("*")
    words = [w for w in decl.replace("*", " ").split() if w != "const"]
    if len(words) == 1:
        base, name = words[0], ""
    else:
        *types, name = words
        base = " ".join(types)
    return CType(base, pointers, int(array.group(1)) if array else None), name


def parse_functions(text: str) -> dict[str, Function]:
    """Every `kvpilot_*` function declaration of a C header."""
    found: dict[str, Function] = {}
    for m in re.finditer(r"([A-Za-z_][\w \t*]*?)\b(kvpilot_\w+)\s*\(([^()]*)\)\s*;", _strip_comments(text)):
        ret, _ = _ctype(m.group(1) + " x")
        params = " ".join(m.group(3).split())
        args = () if params in ("", "void") else tuple(_ctype(p)[0] for p in params.split(","))
        found[m.group(2)] = Function(m.group(2), ret, args)
    return found


def parse_structs(text: str) -> dict[str, list[tuple[str, CType]]]:
    """Every `typedef struct { ... } name;` of a C header: its fields in order."""
    structs: dict[str, list[tuple[str, CType]]] = {}
    for m in re.finditer(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", _strip_comments(text), flags=re.S):
        fields: list[tuple[str, CType]] = []
        for member in filter(None, (s.strip() for s in m.group(1).split(";"))):
            first, *more = member.split(",")
            ctype, name = _ctype(first)
            fields.append((name, ctype))
            for extra in more:  # `const uint16_t *scales, *mins`: the base type, each its own stars
                t, n = _ctype(ctype.base + " " + extra)
                fields.append((n, t))
        structs[m.group(2)] = fields
    return structs


def test_the_parser_reads_declarations() -> None:
    text = """
    /* a comment with kvpilot_fake(int); inside */
    const char *kvpilot_name(void);
    int kvpilot_f(const void *x, long n,
                  const uint8_t *const *w, float s);
    typedef struct { const uint16_t *a, *b; long s[4]; kv_other o; __typeof__(kvpilot_f) *fn; } kv_t;
    """
    fns = parse_functions(text)
    assert set(fns) == {"kvpilot_name", "kvpilot_f"}
    assert fns["kvpilot_name"] == Function("kvpilot_name", CType("char", 1), ())
    assert fns["kvpilot_f"].args == (CType("void", 1), CType("long"), CType("uint8_t", 2), CType("float"))
    assert parse_structs(text)["kv_t"] == [
        ("a", CType("uint16_t", 1)),
        ("b", CType("uint16_t", 1)),
        ("s", CType("long", 0, 4)),
        ("o", CType("kv_other")),
        ("fn", CType("kvpilot_f", function_pointer=True)),
    ]
    assert CType("long", 0, 4).matches(ctypes.c_long * 4) and not CType("long", 0, 4).matches(
        ctypes.c_long * 3
    )
    assert CType("int").matches(ctypes.c_int) and not CType("int").matches(ctypes.c_long)


def _libraries() -> dict[str, ctypes.CDLL]:
    """Each extension's library, built and declared by its module (at the ISA level selected here)."""
    libs: dict[str, ctypes.CDLL] = {}
    for source, ext in EXTENSIONS.items():
        try:
            libs[source] = ext.library()
        except (cbuild.KernelBuildError, OSError) as exc:
            missing(f"a C compiler for the CPU kernels ({exc})", "install gcc or clang")
    return libs


def _declared(lib: ctypes.CDLL) -> dict[str, Any]:
    """The functions a module declared on its library (ctypes keeps each one looked up by name)."""
    return {name: fn for name, fn in vars(lib).items() if name.startswith("kvpilot_")}


def test_every_extension_is_listed() -> None:
    assert sorted(EXTENSIONS) == sorted(p.name for p in CSRC.glob("*.c"))
    for source in CSRC.glob("*.c"):
        assert '#include "kvpilot_kernels.h"' in source.read_text(), source.name


def test_ctypes_declarations_match_the_header() -> None:
    header = parse_functions(HEADER.read_text())
    declared_anywhere: set[str] = set()
    for source, lib in _libraries().items():
        for name, fn in _declared(lib).items():
            declared_anywhere.add(name)
            assert name in header, f"{source}: ctypes declares {name}, which kvpilot_kernels.h does not"
            want = header[name]
            assert fn.argtypes is not None, f"{name}: no argtypes (ctypes would not check the call)"
            assert len(fn.argtypes) == len(want.args), (
                f"{name}: {len(fn.argtypes)} argtypes, header {len(want.args)}"
            )
            for i, (got, c) in enumerate(zip(fn.argtypes, want.args, strict=True)):
                assert c.matches(got), f"{name} argument {i}: ctypes {got.__name__}, header {c}"
            assert want.restype.matches(fn.restype), f"{name} returns {want.restype}, ctypes {fn.restype}"
    assert declared_anywhere == set(header), f"declared in the header only: {set(header) - declared_anywhere}"


def test_decoder_structs_match_the_header() -> None:
    header = parse_structs(HEADER.read_text())
    assert set(header) == set(STRUCTS)
    for cname, cls in STRUCTS.items():
        fields = cls._fields_
        assert [n for n, _ in fields] == [n for n, _ in header[cname]], cname
        for (name, ct), (_, c) in zip(fields, header[cname], strict=True):
            assert c.matches(ct), f"{cname}.{name}: ctypes {ct.__name__}, header {c}"


def test_every_exported_symbol_is_declared() -> None:
    """What each built library exports (its dynamic symbol table) is the header's functions."""
    nm = require_tool("nm", "install binutils")
    header = parse_functions(HEADER.read_text())
    _libraries()  # built (or missing)
    for source, ext in EXTENSIONS.items():
        out = subprocess.run(
            [nm, "-D", "--defined-only", str(ext.build())], capture_output=True, text=True, check=True
        ).stdout
        exported = {line.split()[-1] for line in out.splitlines() if re.search(r"\sT\s", line)}
        kernel_symbols = {s for s in exported if s.startswith("kvpilot_")}
        assert kernel_symbols, f"{source} exports no kvpilot_ function"
        assert kernel_symbols <= set(header), f"{source} exports undeclared {kernel_symbols - set(header)}"
        # nothing else leaks out (static helpers stay static)
        assert not {s for s in exported - kernel_symbols if not s.startswith("_")}, source


def test_a_definition_that_disagrees_with_the_header_does_not_compile(tmp_path: Path) -> None:
    """The other half of the contract: the compiler holds each .c file to the header."""
    cc = require_tool("gcc", "install gcc")
    (tmp_path / "kvpilot_kernels.h").write_text(HEADER.read_text())
    bad = tmp_path / "bad.c"
    bad.write_text(
        '#include "kvpilot_kernels.h"\nint kvpilot_silu_mul(const void *gu, void *out) { return 0; }\n'
    )
    proc = subprocess.run([cc, "-std=gnu11", "-fsyntax-only", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "conflicting types" in proc.stderr
