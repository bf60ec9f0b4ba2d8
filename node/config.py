"""The node's configuration: one frozen dataclass, resolved from four layers.

Precedence, highest first: command-line flag > ``DTNODE_*`` environment variable > TOML file
(``--config node.toml`` or ``DTNODE_CONFIG``) > the defaults below. Every field carries its help
string in ``metadata["help"]``; the CLI builds one flag per field from it, so ``dtnode join --help``
documents every setting and nothing can be set in one layer but not in another.

A user mistake (unknown key, impossible value, missing file) raises :class:`ConfigError`, which the
CLI turns into a one-line message and exit code 2. Reading the layers (types, keys, which layer
wins) is ``node/config_layers.py``; validating the merged settings is ``node/config_checks.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from node import config_layers
from node.config_checks import check_config
from node.config_layers import ConfigError


def _help(text: str) -> Any:
    return {"help": text}


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """Everything one node needs to train; see each field's ``help``."""

    # --- run ---
    name: str = field(default="dtnode", metadata=_help("Run name; the default run dir is runs/<name>."))
    run_dir: str = field(
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
    device: str = field(default="auto", metadata=_help("Device: auto (cuda if available), cpu or cuda."))
    threads: int = field(default=0, metadata=_help("torch intra-op threads (0 = torch's default)."))
    log_every: int = field(default=10, metadata=_help("Print a progress line every N inner steps."))
    log_format: str = field(
        default="text",
        metadata=_help(
            "Log lines on stderr: text (a live display of steps and rounds on a terminal, plain lines "
            "otherwise) or json (one JSON object per line: time, level, logger, message, extra fields)."
        ),
    )
    metrics_port: int = field(
        default=0,
        metadata=_help(
            "Serve Prometheus metrics at http://HOST:PORT/metrics, HOST being the --listen host "
            "(0.0.0.0, every interface, by default); 0 = no metrics endpoint."
        ),
    )

    # --- model ---
    model: str = field(
        default="tiny",
        metadata=_help("Model preset: nano (~1M), tiny (~10M), small (~50M), 350m, 1b, 7b."),
    )
    seq_len: int = field(default=0, metadata=_help("Context length in tokens (0 = the preset's)."))
    model_config: str = field(
        default="",
        metadata=_help(
            "A Hugging Face Llama-family config.json (or its folder) to build the model from instead "
            "of --model's preset (node/hf.py); seq_len defaults to its max_position_embeddings."
        ),
    )
    init_from: str = field(
        default="",
        metadata=_help(
            "Start from the weights of a local Hugging Face checkpoint folder (config.json and "
            "*.safetensors); its config.json is the model's unless --model-config is given."
        ),
    )

    # --- data ---
    data: str = field(
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
    data_seed: int = field(default=0, metadata=_help("Seed of the data order (shared by the whole swarm)."))
    shard_index: int = field(default=0, metadata=_help("This node's data shard (0-based)."))
    num_shards: int = field(default=1, metadata=_help("Number of data shards the corpus is split into."))
    batch_size: int = field(default=16, metadata=_help("Sequences per inner step."))
    eval_batches: int = field(default=8, metadata=_help("Held-out batches evaluated after a round."))
    eval_every: int = field(
        default=0, metadata=_help("Eval every N rounds and the last (0 = auto: <= 1 percent).")
    )
    eval_background: str = field(
        default="auto",
        metadata=_help(
            "Held-out eval on its own thread while the next phase trains: on, off, or auto (on with CUDA)."
        ),
    )

    # --- inside the node: local workers and their layout (node/parallel/) ---
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
    pp_schedule: str = field(
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
    precision: str = field(
        default="auto",
        metadata=_help("fp32, bf16 (autocast of the forward pass; fp32 weights), or auto: bf16 on CUDA."),
    )
    compile: str = field(
        default="auto", metadata=_help("torch.compile the model: on, off, or auto (on with CUDA).")
    )
    sequence_parallel: bool = field(
        default=False,
        metadata=_help("With --tp > 1: run norms and residuals on seq_len / tp positions per rank."),
    )
    activation_checkpointing: bool = field(
        default=False, metadata=_help("Recompute each block's activations in the backward pass.")
    )
    grad_accumulation: int = field(
        default=1, metadata=_help("Batches accumulated per inner step (each of --batch-size sequences).")
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

    # --- inner optimizer (AdamW) ---
    inner_steps: int = field(default=50, metadata=_help("H: inner AdamW steps between outer rounds."))
    inner_lr: float = field(default=1e-3, metadata=_help("Peak inner AdamW learning rate."))
    weight_decay: float = field(default=0.1, metadata=_help("Inner AdamW weight decay."))
    beta1: float = field(default=0.9, metadata=_help("Inner AdamW beta1."))
    beta2: float = field(default=0.95, metadata=_help("Inner AdamW beta2."))
    grad_clip: float = field(default=1.0, metadata=_help("Clip the gradient norm to this (0 = off)."))
    lr_schedule: str = field(
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

    # --- outer optimizer (Nesterov SGD) ---
    outer_lr: float = field(default=0.7, metadata=_help("Outer Nesterov SGD learning rate."))
    outer_momentum: float = field(default=0.9, metadata=_help("Outer Nesterov SGD momentum."))
    outer_nesterov: bool = field(
        default=True, metadata=_help("Use Nesterov momentum in the outer step (momentum 0: plain SGD).")
    )
    overlap: bool = field(
        default=False,
        metadata=_help(
            "Overlap each round's all-reduce with the next round's inner steps; the averaged update "
            "is applied one round late (Streaming DiLoCo)."
        ),
    )
    outer_offload: bool = field(
        default=False,
        metadata=_help("Keep the outer state (global params, momentum) on CPU instead of the device."),
    )
    outer_sharding: str = field(
        default="auto",
        metadata=_help(
            "With local workers: split the outer state over them, 1/K per rank (on), keep it whole on "
            "rank 0 (off), or auto: on when they run on GPUs (on CPU every rank shares one host memory, "
            "and the state a joiner fetches is then a gathered copy beside the shards)."
        ),
    )

    # --- checkpoints ---
    checkpoint_every: int = field(
        default=1, metadata=_help("Checkpoint every N outer rounds (0 = only at exit).")
    )
    keep_checkpoints: int = field(default=2, metadata=_help("How many complete checkpoints to keep."))

    # --- swarm ---
    swarm: bool = field(
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
            "Host other nodes dial, if not the listen host, e.g. behind NAT with forwarded ports (needs "
            "fixed --listen and --dht-listen ports)."
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
    codec: str = field(
        default="int8", metadata=_help("Pseudo-gradient wire codec: none, fp16, bf16, int8 or int4.")
    )
    swarm_streams: int = field(
        default=1,
        metadata=_help(
            "All-reduce each round on this many parallel streams (equal shards of the pseudo-gradient); "
            "stream s runs on local rank s mod --local-workers, so set it to the number of local workers "
            "to give every rank one. Peers that use another number do not share rounds with this node."
        ),
    )
    aggregation: str = field(
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
    round_seconds: float = field(
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
    round_deadline: float = field(
        default=300.0, metadata=_help("Seconds an outer round's all-reduce may take, whatever peers do.")
    )
    sync_deadline: float = field(
        default=600.0, metadata=_help("Seconds a joiner may take to fetch the swarm's state.")
    )
    bandwidth_mbit: float = field(
        default=100.0, metadata=_help("Uplink estimate in Mbit/s (faster nodes reduce larger parts).")
    )
    heartbeat: float = field(default=2.0, metadata=_help("Seconds between DHT record refreshes."))
    record_ttl: float = field(
        default=20.0, metadata=_help("Seconds a crashed node's record outlives its last heartbeat.")
    )
    swarm_key_file: str = field(
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
        check_config(self)

    @property
    def resolved_run_dir(self) -> Path:
        return resolve_run_dir(name=self.name, run_dir=self.run_dir)

    @property
    def schedule_horizon(self) -> int:
        """Inner steps over which the LR schedule runs (0 = constant after warmup)."""
        if self.total_steps:
            return self.total_steps
        if self.max_steps:
            return self.max_steps
        return self.max_rounds * self.inner_steps

    def to_toml(self) -> str:
        """The resolved config as TOML that :func:`load_config` reads back to the same object."""
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                text = repr(value)
            lines.append(f"{f.name} = {text}")
        return "\n".join(lines) + "\n"


def resolve_run_dir(*, name: str, run_dir: str) -> Path:
    """``--run-dir``, else ``runs/<name>``."""
    return Path(run_dir) if run_dir else Path("runs") / name


def field_types() -> dict[str, type]:
    hints = get_type_hints(NodeConfig)
    return {f.name: hints[f.name] for f in fields(NodeConfig)}


def layered_values(
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings the layers set (``node/config_layers.py``), typed but not validated together."""
    return config_layers.layered_values(field_types(), config_file=config_file, environ=environ, flags=flags)


def load_config(
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Resolve the config: ``flags`` > ``environ`` (``DTNODE_*``) > TOML file > defaults."""
    values = layered_values(config_file=config_file, environ=environ, flags=flags)
    try:
        return NodeConfig(**values)
    except TypeError as error:  # a wrong type that slipped through coercion
        raise ConfigError(str(error)) from None
    except ConfigError as error:  # a bad value: say it with the flags a user types
        raise ConfigError(config_layers.name_flags(str(error), field_types())) from None


def replace(config: NodeConfig, **changes: Any) -> NodeConfig:
    return dataclasses.replace(config, **changes)
