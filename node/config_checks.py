"""Validating the node's merged settings (``NodeConfig.__post_init__`` calls :func:`check_config`).

Each check raises :class:`~node.config_layers.ConfigError` naming the setting; ``load_config``
rewrites setting names to the flags a user types. The sets of allowed values live here too (the CLI
lists them in ``--help``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from node.config_layers import ConfigError
from protocol.membership.messages import MAX_STREAMS

if TYPE_CHECKING:
    from node.config import NodeConfig

LR_SCHEDULES = ("cosine", "wsd", "constant")
OUTER_SHARDING = ("auto", "on", "off")
DEVICES = ("auto", "cpu", "cuda")
LOG_FORMATS = ("text", "json")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE = ("auto", "on", "off")
EVAL_BACKGROUND = ("auto", "on", "off")


def check_config(config: NodeConfig) -> None:
    """Raise ConfigError for the first impossible value or combination of values in ``config``."""
    positive = (
        "batch_size",
        "inner_steps",
        "eval_batches",
        "num_shards",
        "log_every",
        "keep_checkpoints",
        "grad_accumulation",
        "pp_virtual_stages",
    )
    for key in positive:
        if getattr(config, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {getattr(config, key)}")
    non_negative = (
        "max_rounds", "max_steps", "seed", "threads", "seq_len", "data_seed", "warmup_steps",
        "total_steps", "checkpoint_every", "grad_clip", "weight_decay", "local_workers", "dp", "tp",
        "pp", "microbatches", "eval_every",
    )  # fmt: skip
    for key in non_negative:
        if getattr(config, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(config, key)}")
    if not 0 <= config.shard_index < config.num_shards:
        raise ConfigError(
            f"shard_index must be in [0, num_shards={config.num_shards}), got {config.shard_index}"
        )
    if not 0 < config.val_fraction < 0.5:
        raise ConfigError(f"val_fraction must be in (0, 0.5), got {config.val_fraction}")
    for key in ("beta1", "beta2", "outer_momentum"):
        if not 0 <= getattr(config, key) < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {getattr(config, key)}")
    if not 0 <= config.min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {config.min_lr_ratio}")
    if not 0 < config.wsd_decay_fraction <= 1:
        raise ConfigError(f"wsd_decay_fraction must be in (0, 1], got {config.wsd_decay_fraction}")
    if config.zero not in (1, 3):
        raise ConfigError(f"zero must be 1 or 3, got {config.zero}")
    if not 1 <= config.swarm_streams <= MAX_STREAMS:
        raise ConfigError(f"swarm_streams must be in 1..{MAX_STREAMS}, got {config.swarm_streams}")
    choices = (
        ("lr_schedule", LR_SCHEDULES), ("pp_schedule", PP_SCHEDULES), ("precision", PRECISIONS),
        ("device", DEVICES), ("log_format", LOG_FORMATS), ("outer_sharding", OUTER_SHARDING),
        ("compile", COMPILE), ("eval_background", EVAL_BACKGROUND),
    )  # fmt: skip
    for key, allowed in choices:
        if getattr(config, key) not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {getattr(config, key)!r}")
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"metrics_port must be in [0, 65535] (0 = off), got {config.metrics_port}")
    if config.data and not Path(config.data).exists():
        raise ConfigError(f"data path does not exist: {config.data}")
    for key in ("tokenizer", "model_config", "init_from"):
        if getattr(config, key) and not Path(getattr(config, key)).exists():
            raise ConfigError(f"{key} path does not exist: {getattr(config, key)}")
    positive_reals = (
        "inner_lr", "outer_lr", "local_bucket_mb", "local_timeout", "join_window", "max_wait",
        "round_deadline", "sync_deadline", "bandwidth_mbit", "heartbeat",
    )  # fmt: skip
    for key in positive_reals:
        if not getattr(config, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {getattr(config, key)}")
    if config.max_wait < config.join_window:
        raise ConfigError(f"max_wait ({config.max_wait}) must be at least join_window ({config.join_window})")
    if config.record_ttl < 3 * config.heartbeat + 10:
        raise ConfigError(
            f"record_ttl must be at least 3 x heartbeat + 10 s = {3 * config.heartbeat + 10:g}, got {config.record_ttl:g}"
        )
    if config.start_peers < 1:
        raise ConfigError(f"start_peers must be >= 1, got {config.start_peers}")
    if not (config.round_seconds >= 0 and math.isfinite(config.round_seconds)):
        raise ConfigError(f"round_seconds must be >= 0, got {config.round_seconds}")
    if config.min_peers < 1:
        raise ConfigError(f"min_peers must be >= 1, got {config.min_peers}")
    for key in ("listen", "dht_listen"):
        value = getattr(config, key)
        _, colon, port = value.rpartition(":")
        if value and (not colon or not port.isdigit() or int(port) > 65535):
            raise ConfigError(f"{key} must be HOST:PORT (port 0 = any free port), got {value!r}")
    if config.announce.count(":") == 1:
        raise ConfigError(
            f"announce is a host (the ports are --listen's and --dht-listen's), got {config.announce!r}"
        )
    if config.announce and config.swarm and (not config.dht_listen or config.dht_listen.endswith(":0")):
        raise ConfigError("--announce needs a fixed DHT port: set --dht-listen HOST:PORT")
    if config.announce and config.swarm and not config.client_mode and config.listen.endswith(":0"):
        # Others dial the announced host at our gRPC port: a random one cannot be forwarded.
        raise ConfigError("--announce needs a fixed gRPC port: set --listen HOST:PORT")
    if config.client_mode and config.swarm and not config.peers:
        raise ConfigError("--client-mode needs --peers: a node nobody can dial cannot start a swarm")
    if config.tls and not config.swarm_key_file:
        raise ConfigError("--tls needs --swarm-key-file (the TLS certificates are derived from the key)")
    from protocol.codecs import CODEC_NAMES

    if config.codec not in CODEC_NAMES:
        raise ConfigError(f"codec must be one of {', '.join(CODEC_NAMES)}, got {config.codec!r}")
    from protocol.allreduce.robust import AggregationRule

    try:
        AggregationRule(
            kind=config.aggregation,  # type: ignore[arg-type]  # the rule checks it
            clip_factor=config.clip_factor,
            trim_per_side=config.trim,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # Import here: the model module is heavy and config must stay importable on its own.
    from node.model import MODEL_PRESETS

    if config.model not in MODEL_PRESETS:
        raise ConfigError(f"model must be one of {', '.join(MODEL_PRESETS)}, got {config.model!r}")
