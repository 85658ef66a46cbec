"""A generic loader of frozen config dataclasses from YAML and ``key=value`` overrides.

It knows no field: a config is a tree of frozen, keyword-only dataclasses whose fields hold the
defaults; a YAML file holds an experiment's overrides as a nested mapping, and ``key=value``
overrides from the command line apply on top, with dotted keys (``rollout.group_size=8``) and
values parsed by ``yaml.safe_load``. Any unknown key, moved key or bad value raises one
``ConfigError`` naming the dotted key::

    flat = read_overrides("configs/arith_tiny.yaml", ["train.steps=3"])
    cfg = build(ExperimentConfig, flat, moved={"train.optimizer.learning_rate": "train.optimizer.learning_rate"})

Two hooks keep the few section-specific rules with the sections that have them:
``moved`` (an old dotted key -> its new place, so a renamed key fails with one line naming where
it went) and ``bases`` (a section prefix -> a function that builds the instance the section's
keys override, e.g. a model preset, and names the extra keys it consumed).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

# A section's base: its keys (relative to the section, raw values) -> (the instance they
# override, the keys the function consumed that are not fields).
BaseFn = Callable[[Mapping[str, Any]], tuple[Any, frozenset[str]]]


class ConfigError(ValueError):
    """A config key is unknown, moved or its value invalid; the message names the dotted key."""


def read_overrides(path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The flat ``{dotted key: raw value}`` of a YAML overrides file and ``key=value`` items.

    Raises:
      ConfigError: the file cannot be read, is not YAML, is not a mapping at the top, or an
        override is not ``key=value``.
    """
    flat: dict[str, Any] = {}
    if path:
        try:
            with open(path) as f:
                doc = yaml.safe_load(f)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from e
        if doc is not None and not isinstance(doc, Mapping):
            raise ConfigError(f"{path}: the top level must be a mapping")
        _flatten(doc or {}, "", flat)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            flat[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{key.strip()}: cannot parse {text!r}: {e}") from e
    return flat


def build(
    cls: type,
    flat: Mapping[str, Any],
    *,
    moved: Mapping[str, str] = types.MappingProxyType({}),
    bases: Mapping[str, BaseFn] = types.MappingProxyType({}),
) -> Any:
    """Instantiates dataclass ``cls`` from ``flat`` (``read_overrides``).

    Raises:
      ConfigError: naming the dotted key of the first moved key, unknown key or invalid value.
    """
    for key in flat:
        for old, new in moved.items():
            if key == old or key.startswith(old + "."):
                raise ConfigError(f"{key}: moved to {new + key[len(old) :]}")
    return _build(cls, dict(flat), "", bases)


def _flatten(doc: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in doc.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(value, dotted + ".", out)
        else:
            out[dotted] = value


def _build(cls: type, flat: dict[str, Any], prefix: str, bases: Mapping[str, BaseFn]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    mine = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    base, consumed = None, frozenset()
    if prefix.rstrip(".") in bases:
        base, consumed = bases[prefix.rstrip(".")](mine)
    for rel in mine:
        if rel.split(".")[0] not in fields and rel not in consumed:
            raise ConfigError(f"{prefix}{rel}: unknown key")
    kwargs: dict[str, Any] = {}
    for name in fields:
        hint, dotted = hints[name], prefix + name
        if dataclasses.is_dataclass(hint):
            if dotted in flat:
                raise ConfigError(f"{dotted}: expected a mapping of fields, got {flat[dotted]!r}")
            if any(k.startswith(dotted + ".") for k in flat):
                kwargs[name] = _build(hint, flat, dotted + ".", bases)
        elif dotted in flat:
            kwargs[name] = coerce(flat[dotted], hint, dotted)
    try:
        return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e


def coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against a field annotation (int, float, bool, str, tuple[...], X | None).

    Raises:
      ConfigError: naming ``key`` when the value does not match.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} does not match {hint}")
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads `5e-4` (no dot) as a string; it is still plainly a float.
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
    elif hint is str:
        if value is None:  # `key=` on the command line
            return ""
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    elif origin is tuple:
        if isinstance(value, list | tuple):
            elem = args[0] if args else Any
            return tuple(coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    else:
        return value
    raise ConfigError(f"{key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
