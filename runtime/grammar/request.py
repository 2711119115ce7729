"""The API's structured-output fields -> one `GuidedSpec` (or None), checked before queueing.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}) and vLLM's extras
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (xgrammar's EBNF dialect), on both
/v1/completions and /v1/chat/completions. At most one may ask for a constraint. Every refusal is a
GuidedSpecError naming the field and the problem (the API layer turns it into a 400).

`json_schema.strict: false` is accepted and still enforced: the output always follows the schema
(OpenAI's non-strict mode only makes that best-effort).
"""

from __future__ import annotations

from typing import Any

from kvpilot.runtime.grammar.structured_output import GuidedSpec, GuidedSpecError, check_spec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def spec_from_response_format(rf: Any) -> GuidedSpec | None:
    param = "response_format"
    if not isinstance(rf, dict):
        raise GuidedSpecError(param, "must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "", param)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GuidedSpecError(f"{param}.json_schema", "required: an object with 'name' and 'schema'")
        if "schema" not in js:
            raise GuidedSpecError(f"{param}.json_schema.schema", "required: the JSON schema to follow")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GuidedSpecError(f"{param}.json_schema.strict", "must be a boolean")
        return GuidedSpec.json_schema(js["schema"], f"{param}.json_schema.schema")
    raise GuidedSpecError(f"{param}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def spec_from_guided(name: str, value: Any) -> GuidedSpec:
    if name == "guided_json":
        return GuidedSpec.json_schema(value, name)
    if name == "guided_choice":
        if not isinstance(value, list) or not value:
            raise GuidedSpecError(name, "must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise GuidedSpecError(name, "every choice must be a non-empty string")
        return GuidedSpec.choice(value, name)
    if not isinstance(value, str) or not value:
        raise GuidedSpecError(name, "must be a non-empty string")
    return GuidedSpec("regex" if name == "guided_regex" else "grammar", value, name)


def guided_spec(fields: dict[str, Any]) -> GuidedSpec | None:
    """`fields`: the request's structured-output fields (absent or None when not given). Returns the
    checked spec, or None when nothing constrains the output."""
    specs: list[GuidedSpec] = []
    given: list[str] = []
    rf = fields.get("response_format")
    if rf is not None:
        spec = spec_from_response_format(rf)
        if spec is not None:
            specs.append(spec)
            given.append("response_format")
    for name in GUIDED_FIELDS:
        value = fields.get(name)
        if value is not None:
            specs.append(spec_from_guided(name, value))
            given.append(name)
    if len(specs) > 1:
        raise GuidedSpecError(
            given[1], f"only one structured-output field may be set, got {', '.join(given)}"
        )
    if not specs:
        return None
    check_spec(specs[0])
    return specs[0]
