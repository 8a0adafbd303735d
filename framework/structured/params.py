"""What a request asks its output to follow: `StructuredOutputsParams` (vLLM's name and
fields), and the request fields that map onto it (OpenAI's `response_format`, vLLM's
`structured_outputs` object and legacy `guided_*` fields).

Exactly one constraint per request. Sizes are bounded (a schema, a grammar, choices) so
no request makes the engine compile without limit; the backend's own cheap validation
runs in the front end, so an invalid schema, regex or grammar is a 400 naming the field.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from portaserve.framework.errors import InvalidParameterError, invalid
from portaserve.framework.structured.constraint import Constraint, GrammarError

#: bytes of a schema, regex or grammar, and choices per request
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 1024
GRAMMAR_SYNTAXES = ("ebnf", "lark")


@dataclass
class StructuredOutputsParams:
    """One of: `json` (a JSON schema, dict or JSON text), `json_object` (any JSON object),
    `regex`, `choice` (a list of strings), `grammar` (GBNF / EBNF, or Lark with
    `grammar_syntax="lark"`), `structural_tag` (xgrammar's, as JSON text)."""

    json: Any = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    #: forced tool calls in a tool parser's format (set by the server; see constraint.py)
    tool_calls: dict | None = None
    #: no optional whitespace in JSON (vLLM's flag of the same name)
    disable_any_whitespace: bool = False
    grammar_syntax: str = "ebnf"
    #: where the error names the constraint ("response_format", "guided_json", ...)
    field_name: str = "structured_outputs"
    #: reasoning models: the token ids that end the reasoning section (`</think>`); the
    #: constraint applies from after them (set by the server from its reasoning parser)
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, list, bool)):
            self.json = _json.dumps(self.json)
        self.constraint()  # validates

    def constraint(self) -> Constraint:
        name = self.field_name
        given = {k: v for k, v in (("json", self.json), ("json_object", self.json_object or None),
                                   ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar),
                                   ("structural_tag", self.structural_tag), ("tool_calls", self.tool_calls))
                 if v is not None}
        if len(given) != 1:
            raise invalid(name, f"needs exactly one of json, json_object, regex, choice, grammar, structural_tag; "
                                f"got {sorted(given) or 'none'}")
        (kind, value), = given.items()
        if self.grammar_syntax not in GRAMMAR_SYNTAXES:
            raise invalid(name, f"grammar_syntax must be one of {GRAMMAR_SYNTAXES}, got {self.grammar_syntax!r}")
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise invalid(name, "choice must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise invalid(name, f"choice has {len(value)} entries, more than the limit of {MAX_CHOICES}")
            spec = _json.dumps(value)
        elif kind == "json_object":
            spec = ""
        elif kind == "tool_calls":
            for schema in value.get("schemas", ()):
                _check_schema(schema, name)
            spec = _json.dumps(value, sort_keys=True)
        else:
            if not isinstance(value, str):
                raise invalid(name, f"{kind} must be a string, got {type(value).__name__}")
            spec = value
        if len(spec.encode("utf-8", "replace")) > MAX_SPEC_BYTES:
            raise invalid(name, f"the {kind} is larger than the limit of {MAX_SPEC_BYTES} bytes")
        if kind == "json":
            try:
                schema = _json.loads(spec)
            except ValueError as exc:
                raise invalid(name, f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise invalid(name, "the JSON schema must be an object")
            _check_schema(schema, name)
        return Constraint(kind, spec, compact_json=self.disable_any_whitespace, grammar_syntax=self.grammar_syntax)


def _check_schema(schema: Any, name: str) -> None:
    """The schema against its JSON Schema metaschema (jsonschema, when installed)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise invalid(name, f"the JSON schema is invalid at {where}: {exc.message[:300]}") from None


def check_with_backend(params: StructuredOutputsParams, backend_cls: type) -> None:
    """The backend's own validation (front end): a GrammarError becomes a 400 naming the field."""
    try:
        backend_cls.validate(params.constraint())
    except GrammarError as exc:
        raise InvalidParameterError(params.field_name, f"{params.field_name}: {exc}") from None


def from_request(body: Any) -> StructuredOutputsParams | None:
    """The constraint an OpenAI / vLLM request body asks for, or None.

    `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}), `structured_outputs` (vLLM's object), and the legacy
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. Only one
    may be given.
    """
    found: list[StructuredOutputsParams] = []
    compact = bool(getattr(body, "disable_any_whitespace", False))
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        kind = getattr(fmt, "type", None) if not isinstance(fmt, dict) else fmt.get("type")
        if kind == "json_object":
            found.append(StructuredOutputsParams(json_object=True, disable_any_whitespace=compact,
                                                 field_name="response_format"))
        elif kind == "json_schema":
            spec = getattr(fmt, "json_schema", None) if not isinstance(fmt, dict) else fmt.get("json_schema")
            spec = spec if isinstance(spec, dict) else (spec.model_dump(by_alias=True) if spec is not None else None)
            schema = (spec or {}).get("schema", (spec or {}).get("schema_"))
            if schema is None:
                raise invalid("response_format", "json_schema.schema is required")
            found.append(StructuredOutputsParams(json=schema, disable_any_whitespace=compact, field_name="response_format"))
        elif kind not in (None, "text"):
            raise invalid("response_format", f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        data = dict(so) if isinstance(so, dict) else so.model_dump(exclude_none=True)
        unknown = sorted(set(data) - {"json", "json_object", "regex", "choice", "grammar", "structural_tag",
                                      "disable_any_whitespace", "grammar_syntax"})
        if unknown:
            raise invalid("structured_outputs", f"unknown fields {unknown}")
        data.setdefault("disable_any_whitespace", compact)
        found.append(StructuredOutputsParams(**data, field_name="structured_outputs"))
    for legacy, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, legacy, None)
        if value is not None:
            found.append(StructuredOutputsParams(**{key: value}, disable_any_whitespace=compact, field_name=legacy))
    if len(found) > 1:
        raise invalid(found[1].field_name, f"only one constraint per request; also given: {found[0].field_name}")
    return found[0] if found else None
