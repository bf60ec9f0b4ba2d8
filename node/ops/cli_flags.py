"""The ``join`` (and ``swarm``) flags: one per setting of :class:`~node.config.NodeConfig`, in help
groups that follow its sections.

Every setting becomes ``--flat-name`` (``--inner-steps`` for ``[inner] steps``; a bool also
``--no-flat-name``), its help the field's ``metadata["help"]`` with the default and the environment
variable; :data:`node.config.FLAT_NAMES` maps each flat name to its section and field. ``--help``
shows one group per section, in NodeConfig's order. Settings with a fixed set of values (a
``Literal`` type) get argparse ``choices`` (listed in the help; a wrong one is an error that names
the flag). Flags are never matched by prefix (``allow_abbrev=False`` on the parsers):
``--inner-step 5`` is an error, not ``--inner-steps 5``.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Collection
from dataclasses import MISSING

from node.config import FLAT_NAMES, SECTIONS, flat_choices, flat_fields, flat_types
from protocol.gen.dtnode.v1 import allreduce_pb2


def codec_names() -> tuple[str, ...]:
    """The wire codecs, from the contract's ``CodecKind`` enum (importing the codecs needs torch)."""
    keys = allreduce_pb2.CodecKind.keys()
    return tuple(key.removeprefix("CODEC_KIND_").lower() for key in keys if key != "CODEC_KIND_UNSPECIFIED")


def setting_groups() -> dict[str, list[str]]:
    """Each section's flat names, in NodeConfig's order of sections and fields."""
    groups: dict[str, list[str]] = {section: [] for section in SECTIONS}
    for flat, location in FLAT_NAMES.items():
        groups[location.split(".")[0]].append(flat)
    return groups


def add_config_flags(
    parser: argparse.ArgumentParser, only: Collection[str] | None = None
) -> dict[str, argparse._ArgumentGroup]:
    """One flag per setting (of the flat names in ``only``, if given), in its section's help group;
    absent flags stay absent (SUPPRESS), so lower layers show through. Returns the groups by section
    name (callers may add their own flags to them)."""
    types = flat_types()
    choices = flat_choices()
    by_name = flat_fields()

    groups = {}
    for title, names in setting_groups().items():
        summary = (inspect.getdoc(SECTIONS[title]) or title).splitlines()[0].rstrip(".")
        names = [name for name in names if only is None or name in only]
        if not names:
            continue
        group = groups[title] = parser.add_argument_group(f"[{title}] {summary}")
        for name in names:
            f = by_name[name]
            flag = "--" + name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            help_text = f"{f.metadata.get('help', '')} [default: {default!r}; env DTNODE_{name.upper()}]"
            kind = types[name]
            if kind is bool:
                group.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                    help=help_text,
                )  # fmt: skip
            else:
                group.add_argument(
                    flag, dest=name, type=kind, default=argparse.SUPPRESS, choices=choices.get(name),
                    metavar="{" + ",".join(choices[name]) + "}" if name in choices else name.upper(),
                    help=help_text,
                )  # fmt: skip
    return groups
