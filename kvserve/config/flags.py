"""Command-line flags generated from config dataclasses, and configs built back from them.

Both processes' entry points (the `kvserve` CLI and `python -m kvserve.executor`) turn their
config dataclasses into argparse flags here, so an option is one dataclass field with its
help text and never also a hand-written `add_argument` call. It lives in `protos` because
the executor may not import the `kvserve` CLI package.

Per field: the flag is `--` plus the field name with `_` turned into `-`, and its dest is
the field name. The annotation picks the type: `int`, `float`, `str` (each possibly
`| None`), `tuple[X, ...]` (a repeatable flag, or with `nargs` one flag taking several
values) and `bool` (default False: a switch; default True: a `--no-...` switch that turns it
off). `field(metadata=flag(...))` adds the help and may override the flag name, choices,
metavar, argument group and, for a scalar, an optional value (`nargs="?"` with `const`); a
plain dict with the same keys ("help", "flag", "choices", "metavar", "group") works as well,
for modules that should not import this one (kvserve.scheduler.core).

A field that holds another config dataclass (`field(default_factory=..., metadata=nested(...))`)
turns that config's fields into flags of the same parser, so a config is declared once and
embedded where it is used: ServerConfig holds the scheduler's `SchedulerConfig` this way.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_SCALARS = (int, float, str, bool)
_KEYS = frozenset(
    {"help", "flag", "aliases", "choices", "metavar", "group", "nargs", "const", "default", "dest", "nested"}
)
"""What metadata or an override may say about a flag ("default" and "dest": overrides only). "dest"
renames a field's argparse dest where another config's field of that name shares the parser (give
it a "flag" of its own too, and pass its value to `config_from_args` by hand)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults in every --help and keep hand-wrapped descriptions."""


def flag(
    help: str,
    *,
    name: str | None = None,
    aliases: Sequence[str] = (),
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    nargs: str | None = None,
    const: Any = None,
) -> dict[str, Any]:
    """The `field(metadata=...)` of a config field: its help and, rarely, how it is spelled
    (`aliases`: further option strings, such as a short form; `nargs`: "+" or "*" for a tuple
    field given as `--flag A B`, "?" for a scalar whose value may be left off, then `const`)."""
    meta: dict[str, Any] = {"help": help}
    if name is not None:
        meta["flag"] = name
    if aliases:
        meta["aliases"] = tuple(aliases)
    if choices is not None:
        meta["choices"] = tuple(choices)
    if metavar is not None:
        meta["metavar"] = metavar
    if group is not None:
        meta["group"] = group
    if nargs is not None:
        meta["nargs"] = nargs
    if const is not None:
        meta["const"] = const
    return meta


def nested(
    *,
    group: str | None = None,
    exclude: Collection[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `field(metadata=...)` of a field that holds a config dataclass (its `default_factory` gives
    the default). Its fields less `exclude` become flags of the same parser (`group` and `overrides`
    as in `add_flags`); `config_from_args` builds it as its default with those flags' values, and
    `config_to_argv` writes them back."""
    return {"nested": {"group": group, "exclude": tuple(exclude), "overrides": dict(overrides or {})}}


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    group: str | None = None,
    exclude: Collection[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add one flag per field of dataclass `cls` (less `exclude`) to `parser`.

    `group` is the argument group (by title) of the fields whose metadata names none.
    `overrides[name]` replaces metadata keys of one field, or sets its command-line
    "default" where that differs from the dataclass's (a config whose module cannot
    carry the help yet passes it here too).
    """
    overrides = overrides or {}
    names = {f.name for f in dataclasses.fields(cls)}
    if set(overrides) - names:
        raise ValueError(f"overrides name no field of {cls.__name__}: {sorted(set(overrides) - names)}")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        meta = {**f.metadata, **overrides.get(f.name, {})}
        if set(meta) - _KEYS:
            raise ValueError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(set(meta) - _KEYS)}")
        if "nested" in meta:
            inner = meta["nested"]
            add_flags(
                parser,
                type(_field_default(f)),
                group=inner["group"] or meta.get("group", group),
                exclude=inner["exclude"],
                overrides=inner["overrides"],
            )
            continue
        name, kwargs = _argument(cls, f, hints[f.name], meta)
        _group(parser, meta.get("group", group)).add_argument(name, *meta.get("aliases", ()), **kwargs)


def config_from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """An instance of dataclass `cls`: each field from `values` when given there, else from
    the parsed flag of the same name (a repeatable flag's list becomes a tuple). A nested config
    is its default with the values of its fields' flags."""
    for f in dataclasses.fields(typing.cast(Any, cls)):
        if f.name in values:
            continue
        if "nested" in f.metadata:
            inner, default = f.metadata["nested"], _field_default(f)
            dests = {
                g.name: inner["overrides"].get(g.name, {}).get("dest", g.name) for g in dataclasses.fields(default)
            }
            flagged = {name: _parsed(args, dest) for name, dest in dests.items() if name not in inner["exclude"]}
            values[f.name] = dataclasses.replace(default, **flagged)
        else:
            values[f.name] = _parsed(args, f.name)
    return cls(**values)


def _parsed(args: argparse.Namespace, dest: str) -> Any:
    value = getattr(args, dest)
    return tuple(value) if isinstance(value, list) else value


def config_to_argv(
    config: Any, *, exclude: Collection[str] = (), overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> list[str]:
    """The flags that `add_flags` + `config_from_args` turn back into `config` (a dataclass instance):
    for handing a process's configuration to a child process on its command line. Fields at their
    default are left out (a child parses the same defaults). `exclude` and `overrides` as the
    parser's `add_flags` had them, where its flags are spelled otherwise than the fields' own."""
    argv: list[str] = []
    overrides = overrides or {}
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if f.name in exclude:
            continue
        meta = {**f.metadata, **overrides.get(f.name, {})}
        value = getattr(config, f.name)
        if "nested" in meta:
            argv += config_to_argv(value, exclude=meta["nested"]["exclude"], overrides=meta["nested"]["overrides"])
            continue
        default = meta["default"] if "default" in meta else _field_default(f)
        if value == default:
            continue
        kind, repeated = _flag_type(type(config), f.name, hints[f.name])
        dashed = f.name.replace("_", "-")
        if kind is bool and not repeated:
            argv.append(meta.get("flag", f"--no-{dashed}" if default else f"--{dashed}"))
            continue
        name = meta.get("flag", f"--{dashed}")
        if repeated and "nargs" in meta:
            argv += [name, *map(str, value)] if value else []
            continue
        for item in value if repeated else (value,):
            argv += [name, str(item)]
    return argv


def _argument(cls: type, f: dataclasses.Field, hint: object, meta: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The flag name and add_argument keywords of one field."""
    kind, repeated = _flag_type(cls, f.name, hint)
    has_default = (
        "default" in meta or f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    )
    default = meta["default"] if "default" in meta else _field_default(f)
    help_text = str(meta.get("help", f"{cls.__name__}.{f.name}")).replace("%", "%%")
    dashed = f.name.replace("_", "-")
    if kind is bool and not repeated:
        name = meta.get("flag", f"--no-{dashed}" if default else f"--{dashed}")
        return name, {
            "dest": meta.get("dest", f.name),
            "action": "store_false" if default else "store_true",
            "default": bool(default),
            "help": f"turn off: {help_text}" if default else help_text,
        }
    name = meta.get("flag", f"--{dashed}")
    kwargs: dict[str, Any] = {"dest": meta.get("dest", f.name), "type": kind, "help": help_text}
    if repeated and "nargs" in meta:
        kwargs.update(nargs=meta["nargs"], default=list(default or ()))
    elif repeated:
        kwargs.update(action=_Repeat, default=list(default or ()))
    elif has_default:
        kwargs["default"] = default
    else:
        kwargs["required"] = True
    if not repeated and "nargs" in meta:
        kwargs.update(nargs=meta["nargs"], const=meta.get("const"))
    if "choices" in meta:
        kwargs["choices"] = meta["choices"]  # without a metavar, argparse shows {a,b}
    if "metavar" in meta or "choices" not in meta:
        kwargs["metavar"] = meta.get("metavar", name.removeprefix("--").replace("-", "_").upper())
    return name, kwargs


class _Repeat(argparse._AppendAction):
    """argparse's "append" that replaces a non-empty default instead of adding to it: a flag
    whose default is `(a,)` and is given as `--flag b` means `(b,)`, not `(a, b)`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def _flag_type(cls: type, name: str, hint: object) -> tuple[type, bool]:
    """(the argparse type, whether the flag repeats) of an annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in _SCALARS and rest[0] is not bool:
            return rest[0], False
    elif origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS and args[0] is not bool:
            return args[0], True
    elif hint in _SCALARS:
        return typing.cast(type, hint), False
    raise TypeError(f"{cls.__name__}.{name}: no command-line form for {hint!r}; exclude it or extend _flag_type")


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def sections(parser: argparse.ArgumentParser, titles: Sequence[str]) -> None:
    """Create the parser's argument groups `titles`, so that --help shows these sections in this order
    whichever config's flags reach them first (otherwise a group is created by its first flag)."""
    for title in titles:
        argument_group(parser, title)


def argument_group(
    parser: argparse.ArgumentParser, title: str, description: str | None = None
) -> argparse._ArgumentGroup:
    """The parser's argument group called `title`, created on first use; `description` is set
    where the group has none yet."""
    for group in parser._action_groups:  # argparse keeps no public index of its groups
        if group.title == title:
            if description is not None and group.description is None:
                group.description = description
            return group
    return parser.add_argument_group(title, description)


def _group(parser: argparse.ArgumentParser, title: str | None) -> argparse._ActionsContainer:
    """The parser's argument group called `title` (created on first use); the parser itself for None."""
    return parser if title is None else argument_group(parser, title)
