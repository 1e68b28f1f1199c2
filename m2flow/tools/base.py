"""A tool: a name, a JSON schema in the OpenAI function format (what chat templates take as
``tools=``) and ``call(arguments) -> str``. Made from a function with type hints and a
Google-style docstring, or from an object whose class holds one trajectory's state (an
environment): its typed, documented ``call`` method is the tool, ``reset()`` starts a new
trajectory. ``load`` finds either by import path, as a task's config names them.

The records of one call: ``ToolCall`` (parsed from a turn's text) and ``ToolResult`` (its
observation, ok or an error of a counted kind). Standard library only: the schema is made by
transformers' ``get_json_schema``, imported when a tool is made."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

# The error kinds every tool call can end in (a tool adds its own through ToolError).
MALFORMED = "malformed"          # the call's text is not a call: bad JSON, no name, no closing tag
UNKNOWN_TOOL = "unknown_tool"    # no tool of that name in the task
BAD_ARGUMENTS = "bad_arguments"  # the arguments do not fit the tool's schema
TOO_MANY_CALLS = "too_many_calls"  # past the turn's limit on calls
RAISED = "raised"                # the tool raised an exception
TIMEOUT = "timeout"              # the call ran past its timeout

# The built-in tools, by short name.
BUILTINS = {"python": "m2flow.tools.python:PythonSandbox", "calculator": "m2flow.tools.calculator:calculator",
            "search": "m2flow.tools.search:Search"}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: ``id`` is unique within its turn."""
    id: str
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A call's observation: ``text`` is what the model reads next; ``error`` is None for a
    call that went through, else its kind (counted); ``cut`` says the text was cut to the
    response limit."""
    call_id: str
    name: str
    text: str
    error: str | None = None
    seconds: float = 0.0
    cut: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class ToolError(Exception):
    """A failure a tool reports itself: ``kind`` names it (and is counted), the message is the
    observation the model reads."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def error_result(call_id: str, name: str, kind: str, message: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(call_id, name, f"Error: {message}", error=kind, seconds=seconds)


class Tool:
    """One tool as a rollout uses it. ``target`` is the function, or the stateful object's
    bound ``call``; ``factory`` (stateful tools only) makes the object for another trajectory."""

    def __init__(self, target: Callable[..., Any], schema: dict[str, Any],
                 factory: Callable[[], Any] | None = None):
        self.target = target
        self.schema = schema
        self.factory = factory

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def stateful(self) -> bool:
        return self.factory is not None

    def __repr__(self) -> str:
        return f"Tool({self.name!r}{', stateful' if self.stateful else ''})"

    def call(self, arguments: Mapping[str, Any]) -> str:
        """The tool's answer to ``arguments`` (checked against the schema first: a mismatch
        raises ToolError(BAD_ARGUMENTS) without calling)."""
        check_arguments(self.schema, arguments)
        out = self.target(**arguments)
        return out if isinstance(out, str) else json.dumps(out, default=str)

    def reset(self) -> None:
        """Starts a new trajectory: a stateful object's ``reset()``; nothing for a function."""
        owner = getattr(self.target, "__self__", None)
        if self.stateful and hasattr(owner, "reset"):
            owner.reset()

    def copy(self) -> Tool:
        """The tool for another trajectory, running beside this one: a new object of a stateful
        tool's class; the same tool otherwise (a function, or an object without ``reset``,
        such as a search index, is shared)."""
        return Tool(self.factory().call, self.schema, self.factory) if self.stateful else self


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function schema of a typed, documented function or bound method (from
    transformers' ``get_json_schema``), named ``name`` when given."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(fn)
    schema["function"].pop("return", None)  # not part of the format the templates take
    if name is not None:
        schema["function"]["name"] = name
    return schema


def function_tool(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A stateless tool from a function with type hints and a Google-style docstring."""
    return Tool(fn, function_schema(fn, name))


def object_tool(obj: Any, factory: Callable[[], Any] | None = None) -> Tool:
    """A tool from an object with a typed, documented ``call`` method, named by the class's
    ``name`` attribute (else its name in snake case). It is stateful, one object per
    trajectory, when its class defines ``reset`` and ``factory`` makes a fresh one."""
    cls = type(obj)
    name = getattr(obj, "name", None) or re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
    stateful = callable(getattr(obj, "reset", None)) and factory is not None
    return Tool(obj.call, function_schema(obj.call, name), factory if stateful else None)


def load(path: str, **options: Any) -> Tool:
    """The tool at ``path``: a built-in's short name (``python``, ``calculator``, ``search``)
    or an import path, ``package.module:attr`` or ``package.module.attr``. A class is made
    with ``options`` (once more for every further trajectory, if it holds state); a function
    takes none; a Tool is returned as it is."""
    path = BUILTINS.get(path, path)
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"tool {path!r}: not an import path (package.module:name)")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool {path!r}: {e}") from e
    if isinstance(target, Tool):
        return target
    if inspect.isclass(target):
        factory = functools.partial(target, **options)
        return object_tool(factory(), factory)
    if options:
        raise ValueError(f"tool {path!r} is a function: it takes no options ({', '.join(options)})")
    return function_tool(target)


# -- arguments against the schema -------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                       "boolean": (bool,), "array": (list,), "object": (dict,),
                                       "null": (type(None),)}


def _fits(value: Any, schema: Mapping[str, Any]) -> bool:
    if value is None and schema.get("nullable"):
        return True
    if "enum" in schema and value not in schema["enum"]:
        return False
    kinds = schema.get("type")
    if kinds is None:
        return True
    kinds = [kinds] if isinstance(kinds, str) else kinds
    for kind in kinds:
        types = _TYPES.get(kind, (object,))
        if isinstance(value, bool) and bool not in types:
            continue  # JSON's true is no number
        if isinstance(value, types):
            if kind == "array" and "items" in schema:
                return all(_fits(v, schema["items"]) for v in value)
            return True
    return False


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> None:
    """Raises ToolError(BAD_ARGUMENTS), with a message for the model, unless ``arguments``
    fits the function schema: an object with every required name, no other names, and
    values of the declared JSON types."""
    params = schema["function"].get("parameters", {})
    properties = params.get("properties", {})
    if not isinstance(arguments, Mapping):
        raise ToolError(BAD_ARGUMENTS, f"the arguments must be a JSON object, not {type(arguments).__name__}")
    takes = ", ".join(properties) or "no arguments"
    for key in arguments:
        if key not in properties:
            raise ToolError(BAD_ARGUMENTS, f"unknown argument {key!r} (the tool takes {takes})")
    for key in params.get("required", []):
        if key not in arguments:
            raise ToolError(BAD_ARGUMENTS, f"missing argument {key!r} (the tool takes {takes})")
    for key, value in arguments.items():
        if not _fits(value, properties[key]):
            wanted = properties[key].get("type", "a listed value")
            raise ToolError(BAD_ARGUMENTS, f"argument {key!r} must be {wanted}, not {json.dumps(value)[:80]}")
