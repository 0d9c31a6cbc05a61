"""``ConfigModel``: the base of kernel_pytorch's pydantic configs, whose validation errors read as one line per
wrong option (:class:`~kernel_pytorch.errors.ConfigError`, a ``ValueError``): the option, the value given and the
values its annotation allows, in place of pydantic's one entry per Union member; validators' own messages as
written; unknown options with the closest known name."""

from __future__ import annotations

import contextlib
import difflib
import reprlib
import types
from typing import Annotated, Any, Iterator, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from kernel_pytorch.errors import ConfigError

__all__ = ["ConfigModel", "allowed_values", "not_allowed"]

# Pydantic's error types for a value outside a Literal, bool or None member: the allowed values say it all.
_FINITE_MEMBER_ERRORS = frozenset({"literal_error", "bool_parsing", "bool_type", "none_required"})
# Errors raised by this module's validators, whose messages are already written for users.
_CUSTOM_ERRORS = frozenset({"value_error", "assertion_error"})
_UNION_TYPES = (Union, types.UnionType)
_NOT_A_FIELD = object()

# A value in a message: long lists, dicts or strings cut short.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


class _Place(NamedTuple):
    """Where in a config a pydantic error points: the option's name as written in Python, its annotation,
    and how many leading items of the error's location led there (the rest are pydantic's Union tags)."""

    label: str
    annotation: Any
    depth: int


def allowed_values(annotation: Any) -> tuple:
    """The values of the Literal, bool and None members of ``annotation`` (a Union of them or one alone)."""
    if get_origin(annotation) is Annotated:
        return allowed_values(get_args(annotation)[0])
    if get_origin(annotation) in _UNION_TYPES:
        return tuple(dict.fromkeys(value for member in get_args(annotation) for value in allowed_values(member)))
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if annotation is bool:
        return (True, False)
    return (None,) if annotation is type(None) else ()


def not_allowed(label: str, value: object, allowed: tuple) -> str:
    """The line for a value outside a finite set, e.g. ``mode='fast' is not allowed; use one of: 'auto', ...``."""
    return f"{label}={_SHORT_REPR.repr(value)} is not allowed; use one of: {', '.join(map(repr, allowed))}"


def _without_none(annotation: Any) -> Any:
    """``X`` for ``Optional[X]`` (pydantic puts no Union tag in the location for it); others as they are."""
    if get_origin(annotation) is Annotated:
        return _without_none(get_args(annotation)[0])
    members = [member for member in get_args(annotation) if member is not type(None)]
    return members[0] if get_origin(annotation) in _UNION_TYPES and len(members) == 1 else annotation


def _inner_annotation(annotation: Any, item: object) -> Any:
    """The annotation that location item ``item`` (a field name, a dict key, an index) leads to inside
    ``annotation``, or _NOT_A_FIELD (a Union tag such as ``"literal['auto']"``, or an unknown field)."""
    annotation = _without_none(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        field = annotation.model_fields.get(item) if isinstance(item, str) else None
        return _NOT_A_FIELD if field is None else field.annotation
    if get_origin(annotation) is dict and isinstance(item, str):
        return get_args(annotation)[1]
    if get_origin(annotation) in (tuple, list) and isinstance(item, int):
        return get_args(annotation)[0]
    return _NOT_A_FIELD


def _place(model: type[BaseModel], location: tuple) -> _Place:
    label, annotation, depth = "", model, 0
    for item in location:
        inner = _inner_annotation(annotation, item)
        if inner is _NOT_A_FIELD:
            break
        is_field = isinstance(item, str) and get_origin(_without_none(annotation)) is not dict
        label += (f".{item}" if label else item) if is_field else f"[{item!r}]"
        annotation, depth = inner, depth + 1
    return _Place(label, annotation, depth)


def _unknown_option(place: _Place, name: object) -> str:
    """The line for an option a config does not have, with the closest name it does (difflib)."""
    model = _without_none(place.annotation)
    where = f"{place.label}: " if place.label else ""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return f"{where}unknown option {name!r}"
    close = difflib.get_close_matches(str(name), model.model_fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}unknown {model.__name__} option {name!r}{hint} (options: {', '.join(model.model_fields)})"


def _value_given(data: object, place: _Place, error: dict) -> object:
    """The value as the user passed it (before this module's "before" validators rewrote it) where it is a
    top-level option; pydantic's input otherwise."""
    if place.depth == 1 and isinstance(data, dict) and place.label in data:
        return data[place.label]
    return error.get("input")


def _option_line(model: type[BaseModel], place: _Place, errors: list[dict], data: object) -> list[str]:
    """The line(s) for one option: its validators' own messages, else one line naming value and what fits."""
    custom = [str(error["ctx"]["error"]) for error in errors
              if error["type"] in _CUSTOM_ERRORS and "error" in error.get("ctx", {})]
    if custom:
        return custom
    first = errors[0]
    if first["type"] == "missing":
        return [f"{place.label} is required"]
    if first["type"] == "frozen_instance":
        return [f"{place.label} cannot be set: {model.__name__} is frozen (build a new one with the value)"]
    messages = list(dict.fromkeys(_sentence(error["msg"]) for error in errors
                                  if error["type"] not in _FINITE_MEMBER_ERRORS))
    if not place.label:
        return [f"{model.__name__}: {'; '.join(messages or [_sentence(first['msg'])])}"]
    value, allowed = _value_given(data, place, first), allowed_values(place.annotation)
    if not messages:
        return [not_allowed(place.label, value, allowed)]
    also = f" (or {', '.join(map(repr, allowed))})" if allowed else ""
    return [f"{place.label}={_SHORT_REPR.repr(value)} is not allowed: {' or '.join(messages)}{also}"]


def _sentence(message: str) -> str:
    return message[:1].lower() + message[1:]  # pydantic's "Input should be ..." read after a colon


def _problem_lines(model: type[BaseModel], error: ValidationError, data: object) -> list[str]:
    """One line per wrong option of ``model`` in pydantic's ``error`` (which has one per Union member)."""
    by_option: dict[tuple, tuple[_Place, list[dict]]] = {}
    for detail in error.errors():
        place = _place(model, detail["loc"])
        if detail["type"] == "extra_forbidden":  # an unknown option: a line of its own
            by_option[tuple(detail["loc"])] = (place, [detail])
        else:
            by_option.setdefault(detail["loc"][:place.depth], (place, []))[1].append(detail)
    lines = []
    for location, (place, errors) in by_option.items():
        if errors[0]["type"] == "extra_forbidden":
            lines.append(_unknown_option(place, location[-1]))
        else:
            lines.extend(_option_line(model, place, errors, data))
    return list(dict.fromkeys(lines))


@contextlib.contextmanager
def _readable_errors(model: type[BaseModel], data: object) -> Iterator[None]:
    try:
        yield
    except ValidationError as error:
        # from None: pydantic's own report, one entry per Union member, is what this replaces.
        raise ConfigError(*_problem_lines(model, error, data)) from None


class ConfigModel(BaseModel):
    """Base of the config models: validation errors are raised as ConfigError (``_problem_lines``)."""

    def __init__(self, /, **data: Any) -> None:
        with _readable_errors(type(self), data):
            super().__init__(**data)

    # Marks this __init__ as pydantic's own (as pydantic's RootModel does), so a config nested in another is
    # validated inside the outer one, whose errors then carry the full location (sparse_attention.block).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> ConfigModel:
        with _readable_errors(cls, obj):
            return super().model_validate(obj, **options)

    @classmethod
    def model_validate_json(cls, json_data: Any, **options: Any) -> ConfigModel:
        with _readable_errors(cls, None):
            return super().model_validate_json(json_data, **options)

    def __setattr__(self, name: str, value: Any) -> None:
        with _readable_errors(type(self), {name: value}):
            super().__setattr__(name, value)
