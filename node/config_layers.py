"""The layers a setting comes from, read into typed values: TOML file, ``DTNODE_*`` variables, flags.

Generic over a set of settings, given by flat name and type (``{name: type}``) and by where each
sits in the TOML file (``{section: {field: name}}``; ``node.config`` passes ``NodeConfig``'s): each
layer's keys are checked against those names and its values against those types, and
``layered_values`` merges them by flat name, highest first: flag > environment > TOML. Validating
the merged values is the config's sections' ``__post_init__`` (``node/config.py``).

The TOML file has sections (``[inner]`` then ``steps = 12``). A file of flat names at the top
(``inner_steps = 12``, as written before the sections) still loads, with one warning line that
names the sectioned form.

Types are kept strictly where the layer has them: a TOML file has strings, integers, reals and
booleans of its own, so ``inner_steps = "5"`` is a mistake, not text to parse (an integer is
accepted for a real, as TOML writes ``1`` for one). An environment variable is text, parsed as the
field's type (``DTNODE_INNER_STEPS=5.0`` is a mistake for an integer). Every mistake is a
:class:`ConfigError` naming where it was made: the file, the variable or the command line.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "DTNODE_"
# Environment variables with the prefix that are not config fields.
# Not settings: DTNODE_CONFIG names the TOML file; the others are read by scripts/setup.sh.
RESERVED_ENV = frozenset({"DTNODE_CONFIG", "DTNODE_TORCH_PIP_ARGS", "DTNODE_VENV"})

Types = Mapping[str, type]
Sections = Mapping[str, Mapping[str, str]]
"""Section -> field -> flat name: where each setting sits in the TOML file."""

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user mistake in the configuration: reported in one line, exit code 2."""


def coerce(key: str, value: Any, source: str, kind: type, *, typed: bool = False) -> Any:
    """Convert a raw value (TOML value or env string) to ``kind``, or raise ConfigError.

    ``typed``: the source has types of its own (TOML), so a string for a number or a bool is a
    mistake (``inner_steps = "5"``), not text to parse as an environment variable's is."""
    if isinstance(value, str) and kind is not str and typed:
        raise ConfigError(f"{source}: {key} expects {kind.__name__}, got the string {value!r}")
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{source}: {key} expects true/false, got {value!r}")
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{source}: {key} expects {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: {key} expects {kind.__name__}, got {value!r}")
    return value


def check_keys(keys: Collection[str], types: Types, source: str) -> None:
    unknown = sorted(set(keys) - set(types))
    if unknown:
        raise ConfigError(f"{source}: unknown setting(s): {', '.join(unknown)}{nearest(unknown[0], types)}")


def nearest(key: str, known: Collection[str]) -> str:
    """`` (did you mean X?)`` for the known key closest to a typo'd one, if one is close."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def read_toml(path: str | Path, types: Types, sections: Sections) -> dict[str, Any]:
    """The settings of a TOML file by flat name: ``[section]`` tables of fields, or (the deprecated
    form, with one warning) flat names at the top."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    raw = {key.replace("-", "_"): value for key, value in raw.items()}
    tables = {key: value for key, value in raw.items() if isinstance(value, dict)}
    flat = {key: value for key, value in raw.items() if key not in tables}
    unknown_sections = sorted(set(tables) - set(sections))
    if unknown_sections:
        listed = ", ".join(f"[{key}]" for key in unknown_sections)
        raise ConfigError(f"{path}: unknown section(s) {listed}; the sections are {', '.join(sections)}")
    check_keys(flat, types, str(path))
    if flat:
        _warn_flat(path, next(iter(flat)), sections)
    values = {key: coerce(key, value, str(path), types[key], typed=True) for key, value in flat.items()}
    for section, table in tables.items():
        names = sections[section]
        table = {key.replace("-", "_"): value for key, value in table.items()}
        unknown = sorted(key for key in table if key not in names)
        if unknown:
            listed = ", ".join(f"[{section}] {key}" for key in unknown)
            raise ConfigError(f"{path}: unknown setting(s): {listed}{nearest(unknown[0], names)}")
        for key, value in table.items():
            name = names[key]
            if name in values:
                raise ConfigError(f"{path}: {name} is set twice: as {name} and as [{section}] {key}")
            values[name] = coerce(f"[{section}] {key}", value, str(path), types[name], typed=True)
    return values


def _warn_flat(path: Path, example: str, sections: Sections) -> None:
    """One line: a file of flat names (as before the sections) is read, but deprecated."""
    section, field = next(
        (section, field)
        for section, names in sections.items()
        for field, name in names.items()
        if name == example
    )
    log.warning(
        "%s: settings outside a [section] are deprecated; write each in its section, e.g. "
        "[%s] %s = ... for %s = ... (dtnode writes config.toml that way)",
        path, section, field, example,
    )  # fmt: skip


def read_env(environ: Mapping[str, str], types: Types) -> dict[str, Any]:
    values = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        check_keys({key}, types, f"environment variable {name}")
        values[key] = coerce(key, value, f"environment variable {name}", types[key])
    return values


def layered_values(
    types: Types,
    sections: Sections,
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings the layers set, typed and with known keys, highest layer winning (not yet
    validated together: a light command such as ``dtnode health`` reads just these)."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get("DTNODE_CONFIG") or None
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_toml(config_file, types, sections))
    values.update(read_env(environ, types))
    if flags:
        check_keys(flags, types, "command line")
        values.update({key: coerce(key, value, "command line", types[key]) for key, value in flags.items()})
    return values


def name_flags(message: str, names: Collection[str]) -> str:
    """``message`` with the settings it names written as flags (``inner_steps`` → ``--inner-steps``).

    A setting with an underscore is renamed wherever it stands; a one-word setting (``model``,
    ``data``) only where it opens the message, as in "model must be one of …", so that the same
    word used as a word elsewhere is left alone."""

    def flag(match: re.Match[str]) -> str:
        word = match.group(0)
        if word in names and ("_" in word or match.start() == 0):
            return "--" + word.replace("_", "-")
        return word

    return re.sub(r"(?<![\w\-'\".=/])[a-z][a-z0-9_]*(?![\w\-'\"])", flag, message)
