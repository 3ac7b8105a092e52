"""Typed option objects whose fields carry their rule, their JSON form and their command-line flag.

A field is declared with :func:`option` on a frozen dataclass; from the same declaration come

- validation, once: :func:`check_fields` (called by the class's ``__post_init__``) runs each field's ``check`` in
  declaration order, which turns the given value into its normal form or raises a
  :class:`~fastwan.errors.UserError` naming the value, the rule and the fix;
- the JSON round trip: :func:`to_json` / :func:`from_json` (unknown or repeated keys refused, naming them);
- a JSON Schema: :func:`json_schema`;
- the CLI's flags and help: :func:`add_flags` and :func:`flag_values` (a flag's text is only converted to the
  field's JSON type there; its rules are the field's ``check``), and :func:`cli_text`, which spells a message's
  ``name=`` as the flag a command-line user typed.

Rule: every field with a ``flag`` has ``help``; a field without one is for Python and JSON callers only.

Why dataclasses and not pydantic: a field's rule is fastwan's own check, which raises a
:class:`~fastwan.errors.UserError` subclass (``InvalidArgument`` is a ``ValueError``, which pydantic would wrap
into its own ``ValidationError`` and message); the fields hold Python objects JSON has no type for (PIL images,
NumPy arrays, torch dtypes, step-cache configs), each with its own JSON form here; and the library needs no further
dependency. The JSON Schema is written from the same declarations, so a server can publish it as it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastwan.errors import InvalidArgument, InvalidArgumentType, UserError

REQUIRED = dataclasses.MISSING


@dataclass(frozen=True)
class Option:
    """What one field is. ``schema``: the JSON Schema of its JSON form (``null`` added when ``nullable``);
    ``check``: value -> normal form (raises a user error); ``encode`` / ``decode``: normal form <-> JSON form
    (identity when None); ``flag``: its command-line spelling (None: not a flag), with ``parse`` (text -> value,
    a type conversion), ``metavar``, ``choices``, ``action`` ("store_true", "append") and ``cli_default``."""

    help: str
    schema: Mapping[str, Any]
    nullable: bool = False
    check: Callable[[Any], Any] | None = None
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None
    flag: str | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple | None = None
    action: str | None = None
    cli_default: Any = None


def option(default: Any = REQUIRED, *, factory: Callable[[], Any] | None = None, **spec) -> Any:
    """A dataclass field with an :class:`Option` (``spec``) as its metadata; ``default`` (or ``factory``) as
    dataclasses take it, REQUIRED for none."""
    meta = {"option": Option(**spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def options(cls) -> list[tuple[dataclasses.Field, Option]]:
    """``cls``'s fields with their options, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def check_fields(obj) -> None:
    """Each field of ``obj`` (a frozen dataclass) replaced by its ``check``'s normal form; the first rule broken
    raises (:func:`checked`)."""
    for f, opt in options(type(obj)):
        if opt.check is not None:
            object.__setattr__(obj, f.name, checked(f.name, opt.check, getattr(obj, f.name)))


def checked(name: str, check: Callable[[Any], Any], value):
    """``check(value)``, the rule of the field ``name``; a user error it raises names that field (its ``field``,
    unless the rule set one)."""
    try:
        return check(value)
    except UserError as exc:
        if exc.field is None:
            exc.field = name
        raise


def to_json(obj) -> dict[str, Any]:
    """``obj``'s fields in their JSON form (a dict :func:`json.dumps` writes; :func:`from_json` reads it back)."""
    out = {}
    for f, opt in options(type(obj)):
        value = getattr(obj, f.name)
        out[f.name] = value if value is None or opt.encode is None else opt.encode(value)
    return out


def unique_keys(where: str, noun: str = "key") -> Callable[[list[tuple[str, Any]]], dict]:
    """A ``json.loads`` ``object_pairs_hook``: an object's (key, value) pairs as a dict, a key given twice refused
    (json keeps the last one silently), the error naming ``where`` the object came from and each ``noun``."""
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise InvalidArgument(f"{where} gives {key!r} twice ({seen[key]!r} and {value!r}); give each {noun} "
                                      "once.")
            seen[key] = value
        return seen
    return hook


def from_json(cls, data: str | bytes | Mapping[str, Any]):
    """A ``cls`` from its JSON form: a JSON text or an already parsed object. Every key must be a field of ``cls``
    (an unknown key is refused, naming the closest field), each at most once; missing keys take their defaults; the
    values go through the fields' ``decode`` and then ``cls``'s checks."""
    name = cls.__name__
    if isinstance(data, (str, bytes, bytearray)):
        try:
            data = json.loads(data, object_pairs_hook=unique_keys("the JSON object"))
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"the {name} text is not valid JSON ({exc}); send one JSON object, e.g. "
                                  f"{example(cls)}.") from None
    if not isinstance(data, Mapping):
        raise InvalidArgumentType(f"a {name} is a JSON object, not {type(data).__name__} {data!r}; send e.g. "
                                  f"{example(cls)}.")
    fields = {f.name: opt for f, opt in options(cls)}
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise InvalidArgument(f"{key!r} is not a field of {name}; {hint}the fields are: {', '.join(fields)}.",
                                  field=str(key))
    kwargs = {}
    for key, value in data.items():
        decode = fields[key].decode
        kwargs[key] = value if value is None or decode is None else checked(key, decode, value)
    missing = [f.name for f, _ in options(cls) if f.default is REQUIRED and f.default_factory is REQUIRED
               and f.name not in kwargs]
    if missing:
        raise InvalidArgument(f"a {name} needs {missing[0]!r}; e.g. {example(cls)}.", field=missing[0])
    return cls(**kwargs)


def example(cls) -> str:
    """The smallest JSON object of ``cls``: its required fields, each with a placeholder of its type."""
    sample = {"string": "...", "integer": 1, "number": 1.0, "boolean": False}
    need = {f.name: sample.get(opt.schema.get("type"), "...") for f, opt in options(cls)
            if f.default is REQUIRED and f.default_factory is REQUIRED}
    return json.dumps(need)


def json_schema(cls) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``cls``'s JSON form: one property per field with its description and
    default, the required ones listed, no other property allowed."""
    props, required = {}, []
    for f, opt in options(cls):
        schema = dict(opt.schema)
        if opt.nullable:
            schema = {"anyOf": [schema, {"type": "null"}]}
        schema["description"] = opt.help
        if f.default is REQUIRED and f.default_factory is REQUIRED:
            required.append(f.name)
        else:
            default = f.default if f.default_factory is REQUIRED else f.default_factory()
            if default is None or opt.encode is None:
                schema["default"] = default
            else:
                schema["default"] = opt.encode(default)
        props[f.name] = schema
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": cls.__name__,
            "description": " ".join(doc.split()), "type": "object", "properties": props, "required": required,
            "additionalProperties": False}


# ---- the command line ---------------------------------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One argparse argument per field of ``cls`` with a flag (except ``skip``), its help from the field. An unset
    flag stays None (``cli_default`` aside), so the field's own default applies."""
    for f, opt in options(cls):
        if opt.flag is None or f.name in skip:
            continue
        kw: dict[str, Any] = {"dest": f.name, "help": opt.help}
        if opt.action == "store_true":
            kw.update(action="store_true", default=None)
        else:
            if opt.action == "append":
                kw.update(action="append")
            kw.update(default=opt.cli_default, metavar=opt.metavar or (
                None if opt.choices else opt.flag.lstrip("-").replace("-", "_").upper()))
            if opt.parse is not None:
                kw["type"] = _typed(opt.parse)
            if opt.choices is not None:
                kw["choices"] = opt.choices
            if f.default is REQUIRED and opt.cli_default is None:
                kw["required"] = True
        parser.add_argument(opt.flag, **kw)


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError / TypeError turned into argparse's usage error (one line naming the flag)."""
    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def flag_values(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The fields of ``cls`` the command line set (a flag given, or one with a ``cli_default``)."""
    out = {}
    for f, opt in options(cls):
        if opt.flag is not None and getattr(args, f.name, None) is not None:
            out[f.name] = getattr(args, f.name)
    return out


def cli_text(message: str, *classes) -> str:
    """``message`` with each ``name=`` of a field of ``classes`` that has a flag written as that flag (``steps=0``
    -> ``--steps 0``), as a command-line user spells it; a remark naming the flag for Python callers ("(CLI
    --overwrite)") is dropped."""
    message = re.sub(r"\s*\(CLI:? --[a-z0-9-]+(?: [A-Z]+)?\)|; CLI:? --[a-z0-9-]+(?: [A-Z]+)?(?=\))", "", message)
    for cls in classes:
        for f, opt in options(cls):
            if opt.flag is not None and opt.action != "store_true":
                message = re.sub(rf"(?<![\w.-]){f.name}=(?= |\)|,|;|$)", opt.flag, message)
                message = re.sub(rf"(?<![\w.-]){f.name}=", f"{opt.flag} ", message)
            elif opt.flag is not None:
                message = re.sub(rf"(?<![\w.-]){f.name}=(True|False)", opt.flag, message)
    return message


def boolean(name: str, error: type[Exception] = InvalidArgumentType) -> Callable[[Any], bool]:
    """The rule of a True / False field: a truthy stand-in is refused, not read as a yes (``allow_pickle="no"``
    must not let pickle files, which can run code, load); ``error``: the exception it raises."""
    def check(value):
        if not isinstance(value, bool):
            raise error(f"{name}={value!r} must be True or False.")
        return value
    return check


def integer_text(text: str) -> int:
    """A flag's whole number ('12' -> 12), e.g. for sizes and seeds; its rules are the field's."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


def number_text(text: str) -> float:
    """A flag's real number ('5' -> 5.0); its rules are the field's."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
