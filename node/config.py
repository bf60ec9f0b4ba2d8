"""The node's configuration: frozen sections of settings, resolved from four layers.

:class:`NodeConfig` is one frozen section per concern (``config.inner.steps``, ``config.rounds.codec``,
``config.network.listen`` …); each section checks its own values in ``__post_init__``, so a section
that exists is valid. Every field carries its help string in ``metadata["help"]``.

Precedence, highest first: command-line flag > ``DTNODE_*`` environment variable > TOML file
(``--config node.toml`` or ``DTNODE_CONFIG``) > the defaults below. The TOML file has the same
sections (``[inner]`` then ``steps = 12``); flags, environment variables and the Python API's
options name a setting by its *flat name* (``--inner-steps``, ``DTNODE_INNER_STEPS``,
``join_swarm(..., inner_steps=12)``), and :data:`FLAT_NAMES` is the one table from flat name to
``section.field``. The CLI builds one flag per flat name (``node/ops/cli_flags.py``), so
``dtnode join --help`` documents every setting and nothing can be set in one layer but not in another.

A user mistake (unknown key, impossible value, missing file) raises :class:`ConfigError`, which the
CLI turns into a one-line message and exit code 2; messages name settings by their flat names, which
:func:`load_config` rewrites to the flags a user types. Reading the layers (types, keys, which layer
wins) is ``node/config_layers.py``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from node import config_layers
from node.config_layers import ConfigError
from protocol.discovery.addresses import split_host_port
from protocol.membership.messages import MAX_STREAMS

# The settings with a fixed set of values; the CLI lists them as the flags' choices.
Device = Literal["auto", "cpu", "cuda"]
LogFormat = Literal["text", "json"]
LrSchedule = Literal["cosine", "wsd", "constant"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]
Precision = Literal["auto", "fp32", "bf16"]
AutoOnOff = Literal["auto", "on", "off"]
"""``auto`` decides from the hardware (e.g. on with CUDA); ``on`` and ``off`` force it."""
PaceSends = Literal["auto", "off"]
"""``auto``: pace an overlapped fragment round's sends over its overlapped steps; ``off``: full rate."""
Codec = Literal["none", "fp16", "bf16", "int8", "int4", "topk", "topk4"]
"""The wire codecs (``protocol/codecs.py``, the contract's ``CodecKind``)."""
Aggregation = Literal["mean", "clipped", "trimmed"]
"""How an all-reduce part is combined (``protocol/allreduce/robust.py``)."""


def _help(text: str) -> Any:
    return {"help": text}


# --- the checks the sections share; a message names the setting by its flat name ---


def _check_at_least(section: object, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < minimum:
            raise ConfigError(f"{_flat_name(section, name)} must be >= {minimum}, got {value}")


def _check_positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value > 0:  # NaN included
            raise ConfigError(f"{_flat_name(section, name)} must be > 0, got {value}")


def _check_fraction(section: object, name: str, interval: str) -> None:
    """``interval``: ``[0, 1)``, ``[0, 1]`` or ``(0, 1]``."""
    value = getattr(section, name)
    low_ok = value > 0 if interval.startswith("(") else value >= 0
    high_ok = value < 1 if interval.endswith(")") else value <= 1
    if not (low_ok and high_ok):
        raise ConfigError(f"{_flat_name(section, name)} must be in {interval}, got {value}")


def _check_choices(section: object, *names: str) -> None:
    for name in names:
        value, allowed = getattr(section, name), _CHOICES[type(section)][name]
        if value not in allowed:
            raise ConfigError(
                f"{_flat_name(section, name)} must be one of {', '.join(allowed)}, got {value!r}"
                f"{config_layers.nearest(str(value), allowed)}"
            )


def _check_paths_exist(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value and not Path(value).exists():
            raise ConfigError(f"{_flat_name(section, name)} path does not exist: {value}")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_addresses(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value and split_host_port(value) is None:
            raise ConfigError(
                f"{_flat_name(section, name)} must be HOST:PORT (port 0 = any free port), got {value!r}"
            )


# --- the sections, in the order of the TOML file and of ``dtnode join --help`` ---


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run: its name and directory, how long it lasts, seed and device."""

    name: str = field(default="dtnode", metadata=_help("Run name; the default run dir is runs/<name>."))
    dir: str = field(
        default="",
        metadata=_help("Run directory (config, metrics.jsonl, checkpoints). Empty means runs/<name>."),
    )
    max_rounds: int = field(
        default=0,
        metadata=_help("Stop after outer round R, counted over the whole run (0 = train until stopped)."),
    )
    max_steps: int = field(
        default=0,
        metadata=_help("Stop after inner step S, counted over the whole run (0 = no limit)."),
    )
    seed: int = field(default=0, metadata=_help("Seed of the model initialisation and of torch's RNG."))
    device: Device = field(default="auto", metadata=_help("Device: auto (cuda if available), cpu or cuda."))
    threads: int = field(default=0, metadata=_help("torch intra-op threads (0 = torch's default)."))

    def __post_init__(self) -> None:
        _check_at_least(self, 0, "max_rounds", "max_steps", "seed", "threads")
        _check_choices(self, "device")


@dataclass(frozen=True, kw_only=True)
class ArchitectureConfig:
    """The model: a preset, or a Hugging Face config or checkpoint to build it from."""

    preset: str = field(
        default="tiny",
        metadata=_help("Model preset: nano (~1M), tiny (~10M), small (~50M), 350m, 1b, 7b."),
    )
    seq_len: int = field(default=0, metadata=_help("Context length in tokens (0 = the preset's)."))
    hf_config: str = field(
        default="",
        metadata=_help(
            "A Hugging Face Llama-family config.json (or its folder) to build the model from instead "
            "of --model's preset (node/model/hf.py); seq_len defaults to its max_position_embeddings."
        ),
    )
    init_from: str = field(
        default="",
        metadata=_help(
            "Start from the weights of a local Hugging Face checkpoint folder (config.json and "
            "*.safetensors); its config.json is the model's unless --model-config is given."
        ),
    )

    def __post_init__(self) -> None:
        _check_at_least(self, 0, "seq_len")
        _check_paths_exist(self, "hf_config", "init_from")
        # Imported here: the model module imports torch, and the config must stay light to import.
        from node.model.gpt import MODEL_PRESETS

        if self.preset not in MODEL_PRESETS:
            flat = _flat_name(self, "preset")
            raise ConfigError(
                f"{flat} must be one of {', '.join(MODEL_PRESETS)}, got {self.preset!r}"
                f"{config_layers.nearest(self.preset, MODEL_PRESETS)}"
            )


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """The training data: where it is, how it is tokenized, held out and sharded."""

    path: str = field(
        default="",
        metadata=_help(
            "Training data: a text file, a folder of text files, a .bin of token ids (uint16; uint32 "
            "for a tokenizer over 65,535 ids), a .jsonl, a .parquet, a folder of .jsonl/.parquet shards "
            "or a datasets save_to_disk folder. Empty means the embedded corpus: this Python's "
            "standard library sources."
        ),
    )
    tokenizer: str = field(
        default="",
        metadata=_help(
            "A Hugging Face tokenizer.json (or its folder), e.g. from `dtnode tokenizer train`. "
            "Empty means byte tokens (256 bytes + 4 specials)."
        ),
    )
    text_field: str = field(
        default="text", metadata=_help("The text column of .jsonl, .parquet and save_to_disk data.")
    )
    val_fraction: float = field(default=0.01, metadata=_help("Fraction of the corpus held out for eval."))
    seed: int = field(default=0, metadata=_help("Seed of the data order (shared by the whole swarm)."))
    shard_index: int = field(
        default=0,
        metadata=_help(
            "This node's data shard (0-based) and, with --num-shards > 1, its rank: its place in the "
            "order of every round's members, parts and shards (a run of ranked nodes reproduces)."
        ),
    )
    num_shards: int = field(default=1, metadata=_help("Number of data shards the corpus is split into."))

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "num_shards")
        _check_at_least(self, 0, "seed")
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(
                f"shard_index must be in [0, num_shards={self.num_shards}), got {self.shard_index}"
            )
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")
        _check_paths_exist(self, "path", "tokenizer")

    @property
    def rank(self) -> int | None:
        """This node's place in the swarm's member order (``records.member_order``): its shard index
        when the shards are set (``dtnode swarm`` numbers its nodes so), else None (by peer id)."""
        return self.shard_index if self.num_shards > 1 else None


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    """The inner phase: H steps of AdamW on this node's batches, and its LR schedule."""

    steps: int = field(default=50, metadata=_help("H: inner AdamW steps between outer rounds."))
    batch_size: int = field(default=16, metadata=_help("Sequences per inner step."))
    grad_accumulation: int = field(
        default=1, metadata=_help("Batches accumulated per inner step (each of --batch-size sequences).")
    )
    lr: float = field(default=1e-3, metadata=_help("Peak inner AdamW learning rate."))
    weight_decay: float = field(default=0.1, metadata=_help("Inner AdamW weight decay."))
    beta1: float = field(default=0.9, metadata=_help("Inner AdamW beta1."))
    beta2: float = field(default=0.95, metadata=_help("Inner AdamW beta2."))
    grad_clip: float = field(default=1.0, metadata=_help("Clip the gradient norm to this (0 = off)."))
    lr_schedule: LrSchedule = field(
        default="cosine",
        metadata=_help("Inner LR schedule after warmup: cosine, wsd (warmup-stable-decay) or constant."),
    )
    warmup_steps: int = field(default=50, metadata=_help("Linear LR warmup steps."))
    total_steps: int = field(
        default=0,
        metadata=_help(
            "Schedule horizon in inner steps (0 = max_steps, else max_rounds x inner_steps, "
            "else constant after warmup)."
        ),
    )
    min_lr_ratio: float = field(default=0.1, metadata=_help("Final LR as a fraction of the peak."))
    wsd_decay_fraction: float = field(
        default=0.2, metadata=_help("wsd: fraction of the horizon spent decaying.")
    )

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "steps", "batch_size", "grad_accumulation")
        _check_at_least(self, 0, "warmup_steps", "total_steps", "grad_clip", "weight_decay")
        _check_positive(self, "lr")
        _check_fraction(self, "beta1", "[0, 1)")
        _check_fraction(self, "beta2", "[0, 1)")
        _check_fraction(self, "min_lr_ratio", "[0, 1]")
        _check_fraction(self, "wsd_decay_fraction", "(0, 1]")
        _check_choices(self, "lr_schedule")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer step: Nesterov SGD on the averaged pseudo-gradient, and where its state lives."""

    lr: float = field(default=0.7, metadata=_help("Outer Nesterov SGD learning rate."))
    momentum: float = field(default=0.9, metadata=_help("Outer Nesterov SGD momentum."))
    nesterov: bool = field(
        default=True, metadata=_help("Use Nesterov momentum in the outer step (momentum 0: plain SGD).")
    )
    overlap: bool = field(
        default=False,
        metadata=_help(
            "Overlap each round's all-reduce with the next round's inner steps; the averaged update "
            "is applied one round late (Streaming DiLoCo)."
        ),
    )
    fragments: int = field(
        default=1,
        metadata=_help(
            "F: synchronise the model a fragment at a time (Streaming DiLoCo): the parameters in F "
            "fragments (blocks strided, sizes balanced), each with its own round every --inner-steps at offset f*H/F, its "
            "own all-reduce and outer momentum; a round is then one fragment's (F rounds per H steps). "
            "1 = the whole model at once."
        ),
    )
    fragment_mix: float = field(
        default=0.0,
        metadata=_help(
            "With --fragments: alpha, the share of a fragment's local params kept when its round lands "
            "(local <- alpha*local + (1-alpha)*global; 0 = restart the fragment from the global params)."
        ),
    )
    overlap_steps: int = field(
        default=0,
        metadata=_help(
            "With --fragments: tau, inner steps a fragment's round overlaps before it lands (0 = "
            "synchronous; at most --inner-steps / --fragments)."
        ),
    )
    pace_sends: PaceSends = field(
        default="auto",
        metadata=_help(
            "With --fragments and --overlap-steps: spread each fragment round's sends over its tau "
            "overlapped steps (a rate of its bytes / (tau x the measured step time x a margin)) instead "
            "of one burst at full link rate, so a capped link's busiest second carries a fraction of "
            "it (auto); off: full rate. The round's deadlines still hold; pacing can make the loop wait "
            "on a round that runs past its tau steps."
        ),
    )
    offload: bool = field(
        default=False,
        metadata=_help("Keep the outer state (global params, momentum) on CPU instead of the device."),
    )
    sharding: AutoOnOff = field(
        default="auto",
        metadata=_help(
            "With local workers: split the outer state over them, 1/K per rank (on), keep it whole on "
            "rank 0 (off), or auto: on when they run on GPUs (on CPU every rank shares one host memory, "
            "and the state a joiner fetches is then a gathered copy beside the shards)."
        ),
    )

    def __post_init__(self) -> None:
        _check_positive(self, "lr")
        _check_fraction(self, "momentum", "[0, 1)")
        _check_choices(self, "sharding", "pace_sends")
        _check_at_least(self, 1, "fragments")
        _check_at_least(self, 0, "overlap_steps")
        _check_fraction(self, "fragment_mix", "[0, 1)")
        if self.fragments > 1 and self.overlap:
            raise ConfigError(
                "overlap overlaps whole-model rounds; with fragments > 1 overlap a fragment's round by "
                "overlap_steps instead"
            )
        if self.fragments == 1 and (self.overlap_steps or self.fragment_mix):
            raise ConfigError("overlap_steps and fragment_mix apply to fragments > 1 (fragments is 1)")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Inside the node: its local workers, their layout (node/parallel/) and how they compute."""

    local_workers: int = field(
        default=0,
        metadata=_help(
            "Worker processes training this node's replica together (0 = one per CUDA device, else 1); "
            "the node stays one peer of the swarm."
        ),
    )
    dp: int = field(default=0, metadata=_help("Data-parallel size inside the node (0 = planner / 1)."))
    tp: int = field(default=0, metadata=_help("Tensor-parallel size inside the node (0 = planner / 1)."))
    pp: int = field(default=0, metadata=_help("Pipeline stages inside the node (0 = planner / 1)."))
    zero: int = field(
        default=1,
        metadata=_help("ZeRO stage across the node's dp ranks: 1 (AdamW state sharded) or 3 (FSDP2)."),
    )
    pp_schedule: PipelineSchedule = field(
        default="1f1b",
        metadata=_help(
            "Pipeline schedule: gpipe, 1f1b or interleaved (1F1B over --pp-virtual-stages per rank)."
        ),
    )
    pp_virtual_stages: int = field(
        default=2, metadata=_help("--pp-schedule interleaved: pipeline stages held by each rank.")
    )
    microbatches: int = field(
        default=0, metadata=_help("Pipeline micro-batches per dp replica and step (0 = planner / pp).")
    )
    precision: Precision = field(
        default="auto",
        metadata=_help("fp32, bf16 (autocast of the forward pass; fp32 weights), or auto: bf16 on CUDA."),
    )
    compile: AutoOnOff = field(
        default="auto", metadata=_help("torch.compile the model: on, off, or auto (on with CUDA).")
    )
    sequence_parallel: bool = field(
        default=False,
        metadata=_help("With --tp > 1: run norms and residuals on seq_len / tp positions per rank."),
    )
    activation_checkpointing: bool = field(
        default=False, metadata=_help("Recompute each block's activations in the backward pass.")
    )
    local_bucket_mb: float = field(
        default=64.0,
        metadata=_help(
            "MB pieces in which the local workers assemble and set the node's flat parameter vector "
            "around an outer step (bounds the device memory it takes)."
        ),
    )
    local_timeout: float = field(
        default=300.0, metadata=_help("Seconds a collective among the node's local workers may take.")
    )

    def __post_init__(self) -> None:
        _check_at_least(self, 0, "local_workers", "dp", "tp", "pp", "microbatches")
        _check_at_least(self, 1, "pp_virtual_stages")
        if self.zero not in (1, 3):
            raise ConfigError(f"zero must be 1 or 3, got {self.zero}")
        _check_choices(self, "pp_schedule", "precision", "compile")
        _check_positive(self, "local_bucket_mb", "local_timeout")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The held-out eval after a round."""

    batches: int = field(default=8, metadata=_help("Held-out batches evaluated after a round."))
    every: int = field(
        default=0, metadata=_help("Eval every N rounds and the last (0 = auto: <= 1 percent).")
    )
    background: AutoOnOff = field(
        default="auto",
        metadata=_help(
            "Held-out eval on its own thread while the next phase trains: on, off, or auto (on with CUDA)."
        ),
    )

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "batches")
        _check_at_least(self, 0, "every")
        _check_choices(self, "background")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints of the run dir."""

    every: int = field(default=1, metadata=_help("Checkpoint every N outer rounds (0 = only at exit)."))
    keep: int = field(default=2, metadata=_help("How many complete checkpoints to keep."))

    def __post_init__(self) -> None:
        _check_at_least(self, 0, "every")
        _check_at_least(self, 1, "keep")


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Taking part in a swarm: peers, addresses, NAT, the DHT record's liveness."""

    enabled: bool = field(
        default=True,
        metadata=_help("Take part in a swarm (DHT peer + gRPC server); --no-swarm trains alone, offline."),
    )
    peers: str = field(
        default="",
        metadata=_help("Comma-separated multiaddrs of running nodes to join; empty starts a new swarm."),
    )
    listen: str = field(
        default="0.0.0.0:0",
        metadata=_help("gRPC HOST:PORT (all-reduce, state sync, membership, health); port 0 = any free."),
    )
    dht_listen: str = field(
        default="", metadata=_help("DHT (libp2p) HOST:PORT; empty = the --listen host, any free port.")
    )
    announce: str = field(
        default="",
        metadata=_help(
            "gRPC address other nodes dial, if not the listen address: HOST, or HOST:PORT when a port "
            "forward's outside PORT differs from --listen's (a rented GPU behind a port mapping); the DHT "
            "is announced at HOST too, unless --dht-announce says otherwise. Needs fixed --listen and "
            "--dht-listen ports."
        ),
    )
    dht_announce: str = field(
        default="",
        metadata=_help(
            "DHT address other nodes dial: HOST:PORT or a multiaddr (/ip4/IP/tcp/PORT, /dns/NAME/tcp/PORT), "
            "e.g. a port forward's outside port; empty = --announce's host at --dht-listen's port."
        ),
    )
    client_mode: bool = field(
        default=False,
        metadata=_help(
            "Accept no inbound connections (behind NAT, no port forwarded): contribute to every round and "
            "fetch the state, but own no all-reduce part and serve nothing; needs --peers."
        ),
    )
    use_relay: bool = field(
        default=False,
        metadata=_help("Let libp2p use circuit relays and auto-relay for the DHT (best effort)."),
    )
    bandwidth_mbit: float = field(
        default=100.0, metadata=_help("Uplink estimate in Mbit/s (faster nodes reduce larger parts).")
    )
    heartbeat: float = field(default=2.0, metadata=_help("Seconds between DHT record refreshes."))
    record_ttl: float = field(
        default=20.0, metadata=_help("Seconds a crashed node's record outlives its last heartbeat.")
    )

    def __post_init__(self) -> None:
        _check_positive(self, "bandwidth_mbit", "heartbeat")
        if self.record_ttl < 3 * self.heartbeat + 10:
            raise ConfigError(
                f"record_ttl must be at least 3 x heartbeat + 10 s = {3 * self.heartbeat + 10:g}, got {self.record_ttl:g}"
            )
        _check_addresses(self, "listen", "dht_listen")
        # The syntax of --announce and --dht-announce is checked with the swarm's settings
        # (protocol/discovery/addresses.py), before any socket: here, only what they need.
        announced = [
            f"--{name.replace('_', '-')}" for name in ("announce", "dht_announce") if getattr(self, name)
        ]
        if announced and self.enabled and self.client_mode:
            raise ConfigError(
                f"--client-mode accepts no connections, so it has no address to announce: drop {' and '.join(announced)}"
            )
        if announced and self.enabled and (not self.dht_listen or self.dht_listen.endswith(":0")):
            # A port forward (or a firewall rule) points at one port: a random one cannot be forwarded.
            raise ConfigError(f"{announced[0]} needs a fixed DHT port: set --dht-listen HOST:PORT")
        if self.announce and self.enabled and self.listen.endswith(":0"):
            raise ConfigError("--announce needs a fixed gRPC port: set --listen HOST:PORT")
        if self.client_mode and self.enabled and not self.peers:
            raise ConfigError("--client-mode needs --peers: a node nobody can dial cannot start a swarm")


@dataclass(frozen=True, kw_only=True)
class RoundsConfig:
    """The outer rounds: when one is due, who takes part, how the pseudo-gradient travels and is combined."""

    codec: Codec = field(
        default="int8",
        metadata=_help(
            "Pseudo-gradient wire codec: none, fp16, bf16, int8, int4, topk or topk4 (each block of 4096 "
            "numbers sends only its --topk-density largest, 2 bits each, or 4 with topk4; what is not sent "
            "waits in the error feedback)."
        ),
    )
    topk_density: float = field(
        default=0.015,
        metadata=_help(
            "--codec topk or topk4: fraction of each block's numbers sent, in (0, 1] (0.015: 62 of 4096). "
            "Every node of the swarm must use the same."
        ),
    )
    error_feedback_decay: float = field(
        default=1.0,
        metadata=_help(
            "Error feedback's decay β in [0, 1]: each round sends Δ + β x what the codec left out of the "
            "rounds before (1: all of it; SparseLoCo uses 0.95 with topk and --outer-momentum 0)."
        ),
    )
    streams: int = field(
        default=1,
        metadata=_help(
            "All-reduce each round on this many parallel streams (equal shards of the pseudo-gradient); "
            "stream s runs on local rank s mod --local-workers, so set it to the number of local workers "
            "to give every rank one. Peers that use another number do not share rounds with this node."
        ),
    )
    tier_group_size: int = field(
        default=0,
        metadata=_help(
            "A round of more nodes than this runs its all-reduce in groups of at most this many (each "
            "group, then each column of the groups over one slice, then the slices pulled), so a node "
            "talks to at most 2(G-1) others however large the swarm (while it has at most G² nodes), for "
            "about 1.4x the bytes of one flat round; 0 = always one flat round. The round's leader "
            "decides it for every member."
        ),
    )
    aggregation: Aggregation = field(
        default="mean",
        metadata=_help(
            "How each part of the pseudo-gradient is combined: mean, clipped (each node's norm clipped "
            "to --clip-factor x the median) or trimmed (per number, drop the --trim largest and smallest); "
            "every node of the swarm must use the same."
        ),
    )
    clip_factor: float = field(
        default=2.0, metadata=_help("--aggregation clipped: clip norms to this many times the median norm.")
    )
    trim: int = field(
        default=1, metadata=_help("--aggregation trimmed: values dropped per number on each side.")
    )
    min_peers: int = field(default=1, metadata=_help("Fewest nodes an outer round may have."))
    start_peers: int = field(
        default=1,
        metadata=_help(
            "Start barrier: before its first inner step a node waits (up to --sync-deadline) until this "
            "many nodes of the run are live, itself included, so that none trains rounds alone while the "
            "others start; `dtnode swarm` sets it to --nodes. 1 = start at once."
        ),
    )
    seconds: float = field(
        default=0.0,
        metadata=_help(
            "Rounds due by time: each node trains until its inner phase has lasted this many seconds (at "
            "least one step, and longer while a node of its lineage that is catching up is due) instead "
            "of --inner-steps steps, so nodes of uneven speeds reach each round together, each weighted "
            "by its tokens. 0 = every round is --inner-steps steps."
        ),
    )
    join_window: float = field(
        default=15.0, metadata=_help("Seconds a round's leader waits for its lineage (and joiners due).")
    )
    max_wait: float = field(
        default=120.0, metadata=_help("Seconds a node tries to get into a round before it gives up on it.")
    )
    deadline: float = field(
        default=300.0, metadata=_help("Seconds an outer round's all-reduce may take, whatever peers do.")
    )
    sync_deadline: float = field(
        default=600.0, metadata=_help("Seconds a joiner may take to fetch the swarm's state.")
    )

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= MAX_STREAMS:
            raise ConfigError(f"swarm_streams must be in 1..{MAX_STREAMS}, got {self.streams}")
        if self.tier_group_size == 1 or not 0 <= self.tier_group_size <= 1024:
            raise ConfigError(
                f"tier_group_size must be 0 (flat rounds) or in 2..1024, got {self.tier_group_size}"
            )
        _check_choices(self, "codec")
        if not 0.0 < self.topk_density <= 1.0:
            raise ConfigError(f"topk_density must be in (0, 1], got {self.topk_density}")
        _check_fraction(self, "error_feedback_decay", "[0, 1]")
        # The all-reduce's own rule checks aggregation, clip_factor and trim; imported here because
        # it imports torch, and the config must stay light to import.
        from protocol.allreduce.robust import AggregationRule

        try:
            AggregationRule(kind=self.aggregation, clip_factor=self.clip_factor, trim_per_side=self.trim)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        _check_at_least(self, 1, "min_peers", "start_peers")
        if not (self.seconds >= 0 and math.isfinite(self.seconds)):
            raise ConfigError(f"round_seconds must be >= 0, got {self.seconds}")
        _check_positive(self, "join_window", "max_wait", "deadline", "sync_deadline")
        if self.max_wait < self.join_window:
            raise ConfigError(
                f"max_wait must be at least join_window ({self.join_window:g}), got {self.max_wait:g}"
            )


@dataclass(frozen=True, kw_only=True)
class SecurityConfig:
    """Who may join: the swarm key, TLS, this node's libp2p identity."""

    key_file: str = field(
        default="",
        metadata=_help(
            "File with the swarm's shared key (make one with `dtnode keygen PATH`, mode 0600): only "
            "nodes with the key can join, send or fetch. Empty = an open swarm (a warning says so)."
        ),
    )
    tls: bool = field(
        default=False,
        metadata=_help(
            "Encrypt gRPC with mutual TLS, certificates from a CA derived from the swarm key (needs "
            "--swarm-key-file; every node of the swarm must use it)."
        ),
    )
    identity_path: str = field(
        default="",
        metadata=_help(
            "File with this node's libp2p private key, created on first start (mode 0600) and reused "
            "after: the peer id, and with a fixed --dht-listen port the multiaddr, survive restarts. "
            "Empty = a new peer id at every start."
        ),
    )

    def __post_init__(self) -> None:
        if self.tls and not self.key_file:
            raise ConfigError("--tls needs --swarm-key-file (the TLS certificates are derived from the key)")


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """What the node tells: progress lines, their format, the Prometheus endpoint."""

    log_every: int = field(default=10, metadata=_help("Print a progress line every N inner steps."))
    log_format: LogFormat = field(
        default="text",
        metadata=_help(
            "Log lines on stderr: text (a live display of steps and rounds on a terminal, plain lines "
            "otherwise) or json (one JSON object per line: time, level, logger, message, extra fields)."
        ),
    )
    port: int = field(
        default=0,
        metadata=_help(
            "Serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --metrics-listen; 0 = no "
            "metrics endpoint."
        ),
    )
    listen: str = field(
        default="127.0.0.1",
        metadata=_help(
            "Host (interface) the metrics endpoint binds: loopback by default, as it has no "
            "authentication; 0.0.0.0 serves every interface (for a Prometheus on another machine: "
            "firewall the port to it)."
        ),
    )

    def __post_init__(self) -> None:
        _check_at_least(self, 1, "log_every")
        _check_choices(self, "log_format")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics_port must be in [0, 65535] (0 = off), got {self.port}")
        host = self.listen.strip("[]")
        if not host or any(c.isspace() or c in "/[]" for c in host) or (":" in host and not _is_ip(host)):
            raise ConfigError(
                f"metrics_listen is a host (the port is --metrics-port), e.g. 127.0.0.1 or 0.0.0.0, got {self.listen!r}"
            )


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything one node needs to train, one section per concern; see each field's ``help``.

    Build it from sections (``NodeConfig(inner=InnerConfig(steps=5))``) or from flat names
    (``NodeConfig.from_flat(inner_steps=5)``, ``replace(config, inner_steps=5)``). Every check
    belongs to one section, so a NodeConfig whose sections exist is valid."""

    run: RunConfig = field(default_factory=RunConfig)
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @classmethod
    def from_flat(cls, **settings: Any) -> NodeConfig:
        """The defaults with ``settings`` (flat names, as the flags and the Python API name them)."""
        return replace(cls(), **settings)

    @property
    def resolved_run_dir(self) -> Path:
        return resolve_run_dir(name=self.run.name, run_dir=self.run.dir)

    @property
    def schedule_horizon(self) -> int:
        """Inner steps over which the LR schedule runs (0 = constant after warmup)."""
        if self.inner.total_steps:
            return self.inner.total_steps
        if self.run.max_steps:
            return self.run.max_steps
        return self.rounds_end_step

    @property
    def rounds_end_step(self) -> int:
        """The inner step after which round ``max_rounds`` is due (0: no limit): R x H, or with F
        fragments, whose rounds come F per H steps, ⌊R/F⌋·H + ⌊(R mod F)·H/F⌋
        (``node.outer.fragments.FragmentSchedule.round_step``)."""
        rounds, steps, fragments = self.run.max_rounds, self.inner.steps, self.outer.fragments
        return rounds // fragments * steps + rounds % fragments * steps // fragments

    def describe(self) -> str:
        """Every setting on one line, ``section.field=value`` (the resolved config ``join`` logs); a
        setting the run does not use says so (``--model``'s preset under ``--model-config``)."""
        architecture = self.architecture
        model_file = (
            "--model-config" if architecture.hf_config else "--init-from" if architecture.init_from else ""
        )
        unused = {("architecture", "preset"): f"(unused: the model is {model_file}'s)"} if model_file else {}
        return " ".join(
            f"{section.name}.{f.name}={unused.get((section.name, f.name)) or repr(getattr(values, f.name))}"
            for section in fields(self)
            for values in [getattr(self, section.name)]
            for f in fields(values)
        )

    def to_toml(self) -> str:
        """The resolved config as TOML, in sections, that :func:`load_config` reads back to the same object."""
        blocks = []
        for section in fields(self):
            values = getattr(self, section.name)
            lines = [f"[{section.name}]"]
            lines += [f"{f.name} = {_toml_value(getattr(values, f.name))}" for f in fields(values)]
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks) + "\n"


FLAT_NAMES: Mapping[str, str] = {
    # flat name: flag --inner-steps, variable DTNODE_INNER_STEPS, option join_swarm(inner_steps=…)
    # -> the section and field that hold it (the TOML file's [inner] steps = …)
    "name": "run.name",
    "run_dir": "run.dir",
    "max_rounds": "run.max_rounds",
    "max_steps": "run.max_steps",
    "seed": "run.seed",
    "device": "run.device",
    "threads": "run.threads",
    "model": "architecture.preset",
    "seq_len": "architecture.seq_len",
    "model_config": "architecture.hf_config",
    "init_from": "architecture.init_from",
    "data": "corpus.path",
    "tokenizer": "corpus.tokenizer",
    "text_field": "corpus.text_field",
    "val_fraction": "corpus.val_fraction",
    "data_seed": "corpus.seed",
    "shard_index": "corpus.shard_index",
    "num_shards": "corpus.num_shards",
    "inner_steps": "inner.steps",
    "batch_size": "inner.batch_size",
    "grad_accumulation": "inner.grad_accumulation",
    "inner_lr": "inner.lr",
    "weight_decay": "inner.weight_decay",
    "beta1": "inner.beta1",
    "beta2": "inner.beta2",
    "grad_clip": "inner.grad_clip",
    "lr_schedule": "inner.lr_schedule",
    "warmup_steps": "inner.warmup_steps",
    "total_steps": "inner.total_steps",
    "min_lr_ratio": "inner.min_lr_ratio",
    "wsd_decay_fraction": "inner.wsd_decay_fraction",
    "outer_lr": "outer.lr",
    "outer_momentum": "outer.momentum",
    "outer_nesterov": "outer.nesterov",
    "overlap": "outer.overlap",
    "fragments": "outer.fragments",
    "fragment_mix": "outer.fragment_mix",
    "overlap_steps": "outer.overlap_steps",
    "pace_sends": "outer.pace_sends",
    "outer_offload": "outer.offload",
    "outer_sharding": "outer.sharding",
    "local_workers": "parallel.local_workers",
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "zero": "parallel.zero",
    "pp_schedule": "parallel.pp_schedule",
    "pp_virtual_stages": "parallel.pp_virtual_stages",
    "microbatches": "parallel.microbatches",
    "precision": "parallel.precision",
    "compile": "parallel.compile",
    "sequence_parallel": "parallel.sequence_parallel",
    "activation_checkpointing": "parallel.activation_checkpointing",
    "local_bucket_mb": "parallel.local_bucket_mb",
    "local_timeout": "parallel.local_timeout",
    "eval_batches": "eval.batches",
    "eval_every": "eval.every",
    "eval_background": "eval.background",
    "checkpoint_every": "checkpoint.every",
    "keep_checkpoints": "checkpoint.keep",
    "swarm": "network.enabled",
    "peers": "network.peers",
    "listen": "network.listen",
    "dht_listen": "network.dht_listen",
    "announce": "network.announce",
    "dht_announce": "network.dht_announce",
    "client_mode": "network.client_mode",
    "use_relay": "network.use_relay",
    "bandwidth_mbit": "network.bandwidth_mbit",
    "heartbeat": "network.heartbeat",
    "record_ttl": "network.record_ttl",
    "codec": "rounds.codec",
    "topk_density": "rounds.topk_density",
    "error_feedback_decay": "rounds.error_feedback_decay",
    "swarm_streams": "rounds.streams",
    "tier_group_size": "rounds.tier_group_size",
    "aggregation": "rounds.aggregation",
    "clip_factor": "rounds.clip_factor",
    "trim": "rounds.trim",
    "min_peers": "rounds.min_peers",
    "start_peers": "rounds.start_peers",
    "round_seconds": "rounds.seconds",
    "join_window": "rounds.join_window",
    "max_wait": "rounds.max_wait",
    "round_deadline": "rounds.deadline",
    "sync_deadline": "rounds.sync_deadline",
    "swarm_key_file": "security.key_file",
    "tls": "security.tls",
    "identity_path": "security.identity_path",
    "log_every": "metrics.log_every",
    "log_format": "metrics.log_format",
    "metrics_port": "metrics.port",
    "metrics_listen": "metrics.listen",
}
"""Every setting's flat name -> ``section.field``, in the order of the sections and their fields."""

_LOCATIONS: dict[str, tuple[str, str]] = {
    flat: (location.split(".")[0], location.split(".")[1]) for flat, location in FLAT_NAMES.items()
}
_HINTS = get_type_hints(NodeConfig)
SECTIONS: Mapping[str, type] = {section.name: _HINTS[section.name] for section in fields(NodeConfig)}
"""Section name -> its dataclass, in NodeConfig's order (the TOML file's and ``--help``'s)."""
_FLAT_NAME_OF: dict[type, dict[str, str]] = {
    cls: {name: flat for flat, (section, name) in _LOCATIONS.items() if section == section_name}
    for section_name, cls in SECTIONS.items()
}
_TYPES: dict[type, dict[str, Any]] = {cls: get_type_hints(cls) for cls in SECTIONS.values()}
_CHOICES: dict[type, dict[str, tuple[Any, ...]]] = {
    cls: {name: get_args(kind) for name, kind in hints.items() if get_origin(kind) is Literal}
    for cls, hints in _TYPES.items()
}


def _flat_name(section: object, field_name: str) -> str:
    return _FLAT_NAME_OF[type(section)][field_name]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def flat_fields() -> dict[str, dataclasses.Field[Any]]:
    """Flat name -> the section's field (its ``default`` and ``metadata["help"]``), in table order."""
    by_section = {name: {f.name: f for f in fields(cls)} for name, cls in SECTIONS.items()}
    return {flat: by_section[section][name] for flat, (section, name) in _LOCATIONS.items()}


def flat_types() -> dict[str, type]:
    """Flat name -> the type its value has (a Literal's values' type: ``str`` for the codec)."""
    types = {}
    for flat, (section, name) in _LOCATIONS.items():
        kind = _TYPES[SECTIONS[section]][name]
        types[flat] = type(get_args(kind)[0]) if get_origin(kind) is Literal else kind
    return types


def flat_choices() -> dict[str, tuple[Any, ...]]:
    """Flat name -> its allowed values, for every setting with a Literal type."""
    return {
        flat: _CHOICES[SECTIONS[section]][name]
        for flat, (section, name) in _LOCATIONS.items()
        if name in _CHOICES[SECTIONS[section]]
    }


def flat_defaults() -> dict[str, Any]:
    """Flat name -> default."""
    return {flat: f.default for flat, f in flat_fields().items()}


def flat_values(config: NodeConfig) -> dict[str, Any]:
    """Flat name -> the value ``config`` holds."""
    return {flat: getattr(getattr(config, section), name) for flat, (section, name) in _LOCATIONS.items()}


def replace(config: NodeConfig, **settings: Any) -> NodeConfig:
    """``config`` with ``settings`` (flat names: ``inner_steps=5``) changed, each section checked
    once with all of its changes; ConfigError for a name that is no setting."""
    unknown = sorted(set(settings) - set(_LOCATIONS))
    if unknown:
        listed = ", ".join(unknown)
        raise ConfigError(
            f"unknown setting(s): {listed} (options are settings by flat name, as in FLAT_NAMES)"
        )
    changes: dict[str, dict[str, Any]] = {}
    for flat, value in settings.items():
        section, name = _LOCATIONS[flat]
        changes.setdefault(section, {})[name] = value
    sections = {
        section: dataclasses.replace(getattr(config, section), **values)
        for section, values in changes.items()
    }
    return dataclasses.replace(config, **sections)


def resolve_run_dir(*, name: str, run_dir: str) -> Path:
    """``--run-dir``, else ``runs/<name>``."""
    return Path(run_dir) if run_dir else Path("runs") / name


def _toml_sections() -> dict[str, dict[str, str]]:
    """Section -> field -> flat name: how the TOML file's ``[section] field`` maps to a setting."""
    sections: dict[str, dict[str, str]] = {name: {} for name in SECTIONS}
    for flat, (section, name) in _LOCATIONS.items():
        sections[section][name] = flat
    return sections


def layered_values(
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings the layers set (``node/config_layers.py``) by flat name, typed but not validated."""
    return config_layers.layered_values(
        flat_types(), _toml_sections(), config_file=config_file, environ=environ, flags=flags
    )


def load_config(
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Resolve the config: ``flags`` > ``environ`` (``DTNODE_*``) > TOML file > defaults."""
    values = layered_values(config_file=config_file, environ=environ, flags=flags)
    try:
        return NodeConfig.from_flat(**values)
    except TypeError as error:  # a wrong type that slipped through coercion
        raise ConfigError(str(error)) from None
    except ConfigError as error:  # a bad value: say it with the flags a user types
        raise ConfigError(config_layers.name_flags(str(error), FLAT_NAMES)) from None
