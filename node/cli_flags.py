"""The ``join`` (and ``swarm``) flags: one per :class:`~node.config.NodeConfig` field, in help groups.

Every field becomes ``--field-name`` (a bool also ``--no-field-name``), its help the field's
``metadata["help"]`` with the default and the environment variable. ``--help`` shows them in
:data:`HELP_GROUPS`, in that order; a field no group lists joins the group of the field declared
before it, so a setting added next to its neighbours lands in their group without an edit here.
Settings with a fixed set of values get argparse ``choices`` (listed in the help; a wrong one is an
error that names the flag). Flags are never matched by prefix (``allow_abbrev=False`` on the
parsers): ``--inner-step 5`` is an error, not ``--inner-steps 5``.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import node.config_checks as config_checks
from node.config import NodeConfig, field_types
from protocol.gen.dtnode.v1 import allreduce_pb2

HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "run": ("name", "run_dir", "max_rounds", "max_steps", "seed", "device", "threads",
            "checkpoint_every", "keep_checkpoints"),
    "model and data": ("model", "seq_len", "data", "val_fraction", "data_seed", "shard_index",
                       "num_shards", "batch_size", "eval_batches"),
    "inner optimizer (AdamW)": ("inner_steps", "inner_lr", "weight_decay", "beta1", "beta2", "grad_clip",
                                "lr_schedule", "warmup_steps", "total_steps", "min_lr_ratio",
                                "wsd_decay_fraction"),
    "outer optimizer (Nesterov) and rounds": ("outer_lr", "outer_momentum", "outer_nesterov", "overlap",
                                              "outer_offload", "outer_sharding"),
    "swarm": ("swarm", "peers", "listen", "dht_listen", "announce", "codec", "swarm_streams",
              "aggregation", "clip_factor", "trim", "min_peers", "join_window", "max_wait",
              "round_deadline", "sync_deadline", "bandwidth_mbit", "heartbeat", "record_ttl"),
    "security": ("swarm_key_file", "tls", "identity_path"),
    "intra-node (local workers)": ("local_workers", "dp", "tp", "pp", "zero", "pp_schedule",
                                   "pp_virtual_stages", "microbatches", "precision", "sequence_parallel",
                                   "activation_checkpointing", "grad_accumulation", "local_bucket_mb",
                                   "local_timeout"),
    "observability": ("log_every", "log_format", "metrics_port"),
}  # fmt: skip
"""``--help`` groups, in order; see the module docstring for fields not listed."""

# Settings whose values are a fixed set, with the name of the node.config_checks tuple that lists them.
_CHOICE_CONSTANTS = {
    "lr_schedule": "LR_SCHEDULES",
    "pp_schedule": "PP_SCHEDULES",
    "precision": "PRECISIONS",
    "device": "DEVICES",
    "log_format": "LOG_FORMATS",
    "outer_sharding": "OUTER_SHARDING",
    "compile": "COMPILE",
    "eval_background": "EVAL_BACKGROUND",
}


def codec_names() -> tuple[str, ...]:
    """The wire codecs, from the contract's ``CodecKind`` enum (importing the codecs needs torch)."""
    keys = allreduce_pb2.CodecKind.keys()
    return tuple(key.removeprefix("CODEC_KIND_").lower() for key in keys if key != "CODEC_KIND_UNSPECIFIED")


def setting_choices() -> dict[str, tuple[str, ...]]:
    """Every setting with a fixed set of values, and those values."""
    choices = {"codec": codec_names()}
    for key, constant in _CHOICE_CONSTANTS.items():
        values = getattr(config_checks, constant, None)
        if values is not None and key in field_types():
            choices[key] = tuple(values)
    return choices


def setting_groups() -> dict[str, list[str]]:
    """Each help group's fields, in declaration order; every field is in exactly one group."""
    group_of = {name: title for title, names in HELP_GROUPS.items() for name in names}
    groups: dict[str, list[str]] = {title: [] for title in HELP_GROUPS}
    previous = next(iter(HELP_GROUPS))
    for f in fields(NodeConfig):
        title = group_of.get(f.name, previous)
        groups[title].append(f.name)
        previous = title
    return groups


def add_config_flags(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One flag per config field, in its help group; absent flags stay absent (SUPPRESS), so lower
    layers show through. Returns the groups by title (callers may add their own flags to them)."""
    types = field_types()
    choices = setting_choices()
    by_name = {f.name: f for f in fields(NodeConfig)}
    groups = {}
    for title, names in setting_groups().items():
        group = groups[title] = parser.add_argument_group(title)
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
