"""Reading one configuration file: YAML without duplicate keys, overrides laid over it,
and sections that check each key and name it in every error.

:func:`open_config` returns a :class:`Reader` (the file, for errors) and the top-level
:class:`Section`; the loaders (:mod:`.server`, :mod:`.agent`) ask sections for their keys
and call :meth:`Section.finish` to refuse the keys nobody asked for.
Reading is blocking file I/O of a small file, done once at start-up.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import yaml

from .errors import ConfigError
from .values import parse_str, show

__all__ = ["MISSING", "Reader", "Section", "open_config"]

T = TypeVar("T")

#: What :meth:`Section.raw` returns for a key that is not there (``None`` means "empty").
MISSING: Any = object()


class _DuplicateKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_mapping(loader: _DuplicateKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_DuplicateKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


class Reader:
    """Walks the merged file + override data of one config file; every error it raises
    names the file, the key path, and (for overridden keys) that it came from an override."""

    def __init__(self, source: str, base_dir: Path, overridden: set[str]) -> None:
        self.source = source
        self.base_dir = base_dir
        self.overridden = overridden

    def error(self, path: str, reason: str) -> ConfigError:
        """Return (not raise) the :class:`ConfigError` for the key at ``path``."""
        plain = re.sub(r"\[\d+\]", "", path)
        if any(plain == o or plain.startswith(o + ".") for o in self.overridden):
            reason += " (from an override)"
        where = f"{path}: " if path else ""
        return ConfigError(f"{self.source}: {where}{reason}")

    def section(self, data: Any, path: str) -> Section:
        """Return the :class:`Section` for the mapping ``data`` at ``path`` (empty: no keys)."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise self.error(path, f"expected a mapping of keys, got {show(data)}")
        for key in data:
            if not isinstance(key, str):
                raise self.error(path, f"keys must be strings, got {show(key)}")
        return Section(self, data, path)

    def named_values(self, raw: Any, path: str, name: re.Pattern[str], name_rule: str,
                     parse: Callable[[str, Any], T]) -> dict[str, T]:
        """The mapping at ``path`` whose keys are names (``engines:``, ``engine_urls:``).

        Every key must match ``name`` (else the error says ``name_rule``); ``parse(key,
        value)`` checks each value, raising ValueError with the reason. :data:`MISSING`
        gives an empty dict.
        """
        if raw is MISSING:
            return {}
        section = self.section(raw, path)
        values: dict[str, T] = {}
        for key in list(section.data):
            if not name.fullmatch(key):
                raise self.error(f"{path}.{key}", name_rule)
            try:
                values[key] = parse(key, section.raw(key))
            except ValueError as exc:
                raise self.error(f"{path}.{key}", str(exc)) from None
        return values

    def path_value(self, value: Any, path: str) -> Path:
        """A path; relative ones are resolved against the config file's directory, or the
        current directory for overrides and when there is no file."""
        text = parse_str(value) if not isinstance(value, os.PathLike) else os.fspath(value)
        path_obj = Path(text).expanduser()
        if path_obj.is_absolute():
            return path_obj
        plain = re.sub(r"\[\d+\]", "", path)
        base = Path.cwd() if plain in self.overridden else self.base_dir
        return base / path_obj


class Section:
    """One mapping of a config file; remembers which keys were asked for."""

    def __init__(self, reader: Reader, data: Mapping[str, Any], path: str) -> None:
        self.reader = reader
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def raw(self, key: str) -> Any:
        """The value of ``key`` as YAML gave it, or :data:`MISSING`."""
        self.used.add(key)
        return self.data.get(key, MISSING)

    def get(self, key: str, parse: Callable[[Any], T], default: T) -> T:
        """The parsed value of ``key``, or ``default`` when it is absent."""
        value = self.raw(key)
        if value is MISSING:
            return default
        try:
            return parse(value)
        except ValueError as exc:
            raise self.reader.error(self.key_path(key), str(exc)) from None

    def get_list(
        self, key: str, parse: Callable[[Any], T], default: tuple[T, ...]
    ) -> tuple[T, ...]:
        """The list at ``key`` with every item parsed, or ``default`` when it is absent."""
        value = self.raw(key)
        if value is MISSING:
            return default
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise self.reader.error(self.key_path(key), f"expected a list, got {show(value)}")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(parse(item))
            except ValueError as exc:
                raise self.reader.error(f"{self.key_path(key)}[{index}]", str(exc)) from None
        return tuple(items)

    def get_path(self, key: str, default: Path) -> Path:
        """The path at ``key`` (see :meth:`Reader.path_value`), or ``default``."""
        value = self.raw(key)
        if value is MISSING:
            return default
        try:
            return self.reader.path_value(value, self.key_path(key))
        except ValueError as exc:
            raise self.reader.error(self.key_path(key), str(exc)) from None

    def finish(self) -> None:
        """Refuse keys nobody asked for, suggesting the closest known key."""
        for key in self.data:
            if key in self.used:
                continue
            # A truncated or lengthened key ("certificate" for "cert") is as likely a slip as
            # a misspelt one, but difflib's ratio misses it when the lengths differ a lot.
            close = [k for k in sorted(self.used)
                     if key and (key.startswith(k) or k.startswith(key))]
            close = close or difflib.get_close_matches(key, sorted(self.used), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else (
                f" (known keys: {', '.join(sorted(self.used))})"
            )
            where = self.path or ""
            raise self.reader.error(where, f"unknown key {key!r}{hint}")


def _merge(base: dict[str, Any], overrides: Mapping[str, Any], prefix: str,
           overridden: set[str]) -> None:
    """Lay ``overrides`` (nested mappings and/or dotted keys) over ``base`` in place,
    recording each overridden key path in ``overridden``."""
    for raw_key, value in overrides.items():
        first, _, rest = str(raw_key).partition(".")
        full = f"{prefix}.{first}" if prefix else first
        if rest:
            value = {rest: value}
        if isinstance(value, Mapping):
            current = base.get(first)
            child = dict(current) if isinstance(current, Mapping) else {}
            _merge(child, value, full, overridden)
            base[first] = child
        else:
            base[first] = value
            overridden.add(full)


def _read_yaml(path: Path | None, default_name: str) -> tuple[str, Path, dict[str, Any]]:
    if path is None:
        return default_name, Path.cwd(), {}
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, not a file") from None
    except PermissionError:
        raise ConfigError(f"{source}: not readable by this user (uid {os.getuid()})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason})") from None
    try:
        data = yaml.load(text, Loader=_DuplicateKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: {where}invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top, got {show(data)}")
    return source, path.parent.absolute(), data


def open_config(path: Path | str | None, overrides: Mapping[str, Any] | None,
                default_name: str) -> tuple[Reader, Section]:
    """Read the YAML file at ``path`` (``None``: no file; errors then name ``default_name``),
    lay ``overrides`` over it, and return the reader and the top-level section.

    Raises :class:`ConfigError` if the file is missing, unreadable, not YAML, gives a key
    twice, or is not a mapping at the top.
    """
    source, base_dir, data = _read_yaml(Path(path) if path is not None else None, default_name)
    overridden: set[str] = set()
    merged = dict(data)
    _merge(merged, overrides or {}, "", overridden)
    reader = Reader(source, base_dir, overridden)
    return reader, reader.section(merged, "")
