"""Which rules of a grammar can never finish: a pure check on xgrammar's printed grammar.

xgrammar compiles grammars that no finite text satisfies (`root ::= root`, a regex of an empty
character class such as `[^\\s\\S]`, a JSON schema whose required property refers back to the
schema with no way out). The matcher then allows nothing (the engine aborts the sequence) or lets
generation run until max_tokens. Every kind of constraint (JSON schema, regex, choice, EBNF) is
turned into the same EBNF first (`str(xgrammar.Grammar)`), so one classic check covers them all:

- a rule is *productive* when some alternative derives a finite string: every element is a
  string, a non-empty character class, a productive rule, a productive group, or repeated with a
  minimum of 0 (`*`, `?`, `{0, n}`);
- a grammar whose root is not productive has no instance at all; a rule reachable from the root
  that is not productive is a dead end that generation may enter and never leave.

`find_dead_rule` parses the printed form (rules of strings, character classes, rule references,
groups, alternatives, repetition, lookahead assertions and `Regex(...)` builtins, which it takes
to match something). Anything it does not understand makes
it answer None (no verdict), never a false refusal: a character class is only called empty when its
escapes all parse and its ranges cover every code point.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_REPEAT = re.compile(r"\{\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\}")
_MAX_CODE_POINT = 0x10FFFF
_SIMPLE_ESCAPES = {"n": 10, "r": 13, "t": 9, "f": 12, "v": 11, "0": 0, "a": 7, "b": 8, "e": 27}


class _Unknown(Exception):
    """A construct the analysis does not model: no verdict."""


@dataclass
class _Item:
    atom: object  # "str" | _Class | _Ref | _Alt
    min_count: int = 1


@dataclass
class _Ref:
    name: str


@dataclass
class _Class:
    empty: bool


@dataclass
class _Alt:
    seqs: list[list[_Item]] = field(default_factory=list)


@dataclass(frozen=True)
class DeadRule:
    """`rule` can never finish; `is_root`: the whole grammar has no finite instance."""

    rule: str
    is_root: bool


def _class_is_empty(body: str, negated: bool) -> bool:
    """Whether the character class `[body]` (`[^body]` when negated) matches no code point."""
    ranges: list[tuple[int, int]] = []
    i = 0
    chars: list[int] = []

    def read() -> int:
        nonlocal i
        c = body[i]
        if c != "\\":
            i += 1
            return ord(c)
        if i + 1 >= len(body):
            raise _Unknown
        e = body[i + 1]
        for prefix, width in (("x", 2), ("u", 4), ("U", 8)):
            if e == prefix:
                digits = body[i + 2 : i + 2 + width]
                if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                    raise _Unknown
                i += 2 + width
                return int(digits, 16)
        if e in _SIMPLE_ESCAPES:
            i += 2
            return _SIMPLE_ESCAPES[e]
        if e.isalnum():  # \s \d \w and the like: classes of their own
            raise _Unknown
        i += 2
        return ord(e)

    while i < len(body):
        lo = read()
        if i + 1 < len(body) and body[i] == "-":
            i += 1
            hi = read()
            ranges.append((lo, hi))
        else:
            chars.append(lo)
    ranges.extend((c, c) for c in chars)
    if not negated:
        return not ranges
    covered = 0  # the next code point not yet known to be covered
    for lo, hi in sorted(ranges):
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > _MAX_CODE_POINT


class _Parser:
    """One rule body of xgrammar's printed EBNF -> _Alt."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def _skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _peek(self) -> str:
        self._skip()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def parse(self) -> _Alt:
        alt = self._alt()
        if self._peek():
            raise _Unknown
        return alt

    def _alt(self) -> _Alt:
        alt = _Alt([self._seq()])
        while self._peek() == "|":
            self.pos += 1
            alt.seqs.append(self._seq())
        return alt

    def _seq(self) -> list[_Item]:
        seq: list[_Item] = []
        while self._peek() not in ("", "|", ")"):
            item = self._item()
            if item is not None:
                seq.append(item)
        return seq

    def _item(self) -> _Item | None:
        t = self.text
        c = self._peek()
        if t.startswith("(=", self.pos):  # a lookahead assertion: consumes nothing
            self.pos += 2
            self._alt()
            self._expect(")")
            return None
        if c == "(":
            self.pos += 1
            atom: object = self._alt()
            self._expect(")")
        elif c == '"':
            self.pos = self._end_of('"', self.pos + 1)
            atom = "str"
        elif c == "[":
            negated = t.startswith("[^", self.pos)
            start = self.pos + (2 if negated else 1)
            self.pos = self._end_of("]", start)
            atom = _Class(_class_is_empty(t[start : self.pos - 1], negated))
        else:
            m = _NAME.match(t, self.pos)
            if m is None:
                raise _Unknown
            self.pos = m.end()
            atom = _Ref(m.group(0))
            if t.startswith("(", self.pos):  # a builtin: Regex("...", json_string=true)
                if m.group(0) != "Regex":
                    raise _Unknown
                self._skip_call()
                atom = "str"  # assumed to match something (no verdict on the regex itself)
        return _Item(atom, self._min_count())

    def _skip_call(self) -> None:
        t = self.text
        self.pos += 1
        while self.pos < len(t) and t[self.pos] != ")":
            self.pos = self._end_of('"', self.pos + 1) if t[self.pos] == '"' else self.pos + 1
        self._expect(")")

    def _min_count(self) -> int:
        c = self._peek()
        if c in ("*", "?"):
            self.pos += 1
            return 0
        if c == "+":
            self.pos += 1
            return 1
        if c == "{":
            m = _REPEAT.match(self.text, self.pos)
            if m is None:
                raise _Unknown
            self.pos = m.end()
            return max(0, int(m.group(1)))
        return 1

    def _end_of(self, close: str, pos: int) -> int:
        """The position after the unescaped `close` that ends a literal starting at `pos`."""
        t = self.text
        while pos < len(t):
            if t[pos] == "\\":
                pos += 2
            elif t[pos] == close:
                return pos + 1
            else:
                pos += 1
        raise _Unknown

    def _expect(self, c: str) -> None:
        if self._peek() != c:
            raise _Unknown
        self.pos += 1


def _parse_rules(ebnf: str) -> dict[str, _Alt]:
    rules: dict[str, _Alt] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep or _NAME.fullmatch(name.strip()) is None:
            raise _Unknown
        rules[name.strip()] = _Parser(body).parse()
    return rules


def _refs(alt: _Alt) -> set[str]:
    out: set[str] = set()
    stack: list[object] = [alt]
    while stack:
        a = stack.pop()
        if isinstance(a, _Ref):
            out.add(a.name)
        elif isinstance(a, _Alt):
            stack.extend(item.atom for seq in a.seqs for item in seq)
    return out


def _productive(atom: object, known: set[str]) -> bool:
    if atom == "str":
        return True
    if isinstance(atom, _Class):
        return not atom.empty
    if isinstance(atom, _Ref):
        return atom.name in known
    assert isinstance(atom, _Alt)
    return any(all(i.min_count == 0 or _productive(i.atom, known) for i in seq) for seq in atom.seqs)


def find_dead_rule(ebnf: str, root: str = "root") -> DeadRule | None:
    """The first rule reachable from `root` that can never finish (the root itself when the
    grammar has no finite instance), or None: every reachable rule can finish, or the printed
    grammar has a construct this analysis does not model."""
    try:
        rules = _parse_rules(ebnf)
        refs = {name: _refs(alt) for name, alt in rules.items()}
        if root not in rules or any(r not in rules for rs in refs.values() for r in rs):
            return None
        users: dict[str, set[str]] = defaultdict(set)
        for name, rs in refs.items():
            for r in rs:
                users[r].add(name)
        productive: set[str] = set()
        pending = list(rules)
        while pending:  # a rule is re-checked only when one it refers to turned productive
            name = pending.pop()
            if name not in productive and _productive(rules[name], productive):
                productive.add(name)
                pending.extend(users[name])
        reachable = {root}
        frontier = [root]
        while frontier:
            for r in refs[frontier.pop()]:
                if r not in reachable:
                    reachable.add(r)
                    frontier.append(r)
    except (_Unknown, RecursionError):
        return None
    if root not in productive:
        return DeadRule(root, True)
    dead = [name for name in rules if name in reachable and name not in productive]
    return DeadRule(dead[0], False) if dead else None
