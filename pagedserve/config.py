"""Frozen config dataclasses -> argparse, built once per process.

Every option is a dataclass field with ``metadata={"help": ...}``; ``add_arguments`` turns the
fields into ``--kebab-case`` flags and ``from_namespace`` builds the frozen config back;
``to_flags`` writes a config as those flags (for a child process).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def _field_type(cls: type[DataclassInstance], field: dataclasses.Field[Any]) -> object:
    """The field's type hint, ``X`` for ``X | None``."""
    hint: object = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type[DataclassInstance]) -> None:
    """Adds one ``--flag`` per field of the dataclass ``cls`` to ``parser``."""
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        flag = _flag(field.name)
        kind = _field_type(cls, field)
        default = field.default
        help_text = field.metadata.get("help", "")
        if kind is bool:
            group.add_argument(
                flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{help_text} (default: {default})",
            )
            continue
        choices = field.metadata.get("choices")
        group.add_argument(
            flag,
            dest=field.name,
            type=kind if isinstance(kind, type) and kind in (int, float, str) else str,
            default=default,
            choices=choices,
            help=f"{help_text} (default: {default})",
        )


def to_flags(config: DataclassInstance) -> list[str]:
    """The flags ``add_arguments`` parses back into ``config`` (every field, defaults too)."""
    flags = []
    for field in dataclasses.fields(config):
        flag, value = _flag(field.name), getattr(config, field.name)
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Builds the frozen ``cls`` from the parsed flags (fields absent from ``ns`` keep defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(ns).items() if k in names})
