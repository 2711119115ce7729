"""What is checked in a JSON schema in Python, before any grammar work (pure functions).

- `check_schema_valid`: it is valid JSON Schema (jsonschema's metaschema check), nested at most
  MAX_JSON_DEPTH levels. Pure Python and slow on big schemas (1.4 s for 240 KB): a constraint's
  schema is checked in a grammar worker process, not in the server.
- `unenforced_keyword`: the first place where the schema asks for something xgrammar does not
  enforce. The output of a constraint must always follow the schema, so such a schema is refused
  (naming the keyword and where it is) rather than quietly generating output that may not validate.
  Keywords xgrammar skips silently are listed here (measured on xgrammar 0.2.9: the grammar is the
  same with and without them, and output violating them is accepted); the ones it skips with a
  warning are caught when the grammar is compiled (runtime/grammar/worker.py). References must be
  local (`#` or `#/...`): xgrammar never fetches a URL or a file, it drops such a reference.

A schema keyword is looked for only in schema positions (`properties` values, `items`, `anyOf`
members, ...), never in data (`const`, `enum`, `default`, `examples`) or property names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvpilot.runtime.grammar.json_limits import MAX_JSON_DEPTH, deeper_than

# keyword -> why it is refused (xgrammar does not enforce it)
UNENFORCED: dict[str, str] = {
    "not": "negation",
    "uniqueItems": "unique array items",
    "contains": "array 'contains'",
    "minContains": "array 'contains'",
    "maxContains": "array 'contains'",
    "if": "conditional subschemas",
    "then": "conditional subschemas",
    "else": "conditional subschemas",
    "dependentRequired": "dependent properties",
    "dependentSchemas": "dependent properties",
    "dependencies": "dependent properties",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "recursive references",
}
_NEUTRAL: dict[str, object] = {"uniqueItems": False}  # values that ask for nothing

# keywords whose value is a schema, a list of schemas, or a name -> schema mapping
_ONE: tuple[str, ...] = (
    "additionalProperties",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaProblem(ValueError):
    """A schema refused before compiling; the message says what and where."""


def subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every object schema inside `schema` (itself included) with its path ('properties/a/items'),
    depth first. Iterative: the depth of the schema cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node

        def at(*parts: object, _path: str = path) -> str:
            return "/".join(p for p in (_path, *map(str, parts)) if p)

        for kw in _ONE:
            if kw in node:
                stack.append((at(kw), node[kw]))
        for kw in _MANY:
            if isinstance(node.get(kw), list):
                stack.extend((at(kw, i), s) for i, s in enumerate(node[kw]))
        for kw in _NAMED:
            if isinstance(node.get(kw), dict):
                stack.extend((at(kw, name), s) for name, s in node[kw].items())
        items = node.get("items")
        if isinstance(items, list):  # the tuple form of drafts 4-7
            stack.extend((at("items", i), s) for i, s in enumerate(items))
        elif items is not None:
            stack.append((at("items"), items))
        deps = node.get("dependencies")
        if isinstance(deps, dict):
            stack.extend((at("dependencies", n), s) for n, s in deps.items() if isinstance(s, dict))


def _where(path: str) -> str:
    return f"at '{path}'" if path else "at the top level"


def unenforced_keyword(schema: Any) -> str | None:
    """A message naming the first keyword or reference the grammar cannot enforce, or None."""
    for path, node in subschemas(schema):
        for kw, what in UNENFORCED.items():
            if kw in node and not (kw in _NEUTRAL and node[kw] == _NEUTRAL[kw]):
                return (
                    f"'{kw}' {_where(path)} ({what}) cannot be enforced by the grammar engine; "
                    "remove it or express it another way"
                )
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            return (
                f"'$ref' {_where(path)} is {ref!r}: only references inside the schema ('#' or "
                "'#/...') are supported; nothing is fetched"
            )
    return None


def check_schema_valid(schema: Any) -> None:
    """Raise SchemaProblem unless `schema` is valid JSON Schema nested at most MAX_JSON_DEPTH levels."""
    import jsonschema

    if deeper_than(schema) is not None:
        raise SchemaProblem(f"the schema nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise SchemaProblem(f"invalid JSON schema{f' at {where}' if where else ''}: {e.message}") from None
    except RecursionError:  # a `pattern` whose regex nests too deeply for Python's re parser
        raise SchemaProblem("invalid JSON schema: a value in it nests too deeply to check") from None
