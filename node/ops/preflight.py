"""Checks ``dtnode join`` runs after reading its settings and before it opens any socket.

A setting that cannot work must end the start with one line that names its flag and exit code 2
(``ConfigError``) before the DHT and the gRPC server start and the join banner is printed:
otherwise the user reads "started a new swarm … to join it" followed by an error, and peers may
already have seen the node. :func:`check_before_sockets` checks, cheapest first:

- the device (``--device cuda`` needs one);
- the intra-node layout (``--local-workers``, ``--dp/--tp/--pp``, micro-batches, the planner),
  resolved exactly as the trainer will resolve it (``node.parallel.layout.resolve_layout``) for
  the ``--model`` preset (the layout's rules read heads, layers and the batch, not the vocabulary);
- the swarm side's settings (``node.swarm.setup``): the swarm key file, the ``--identity-path``
  file, the ``--peers`` multiaddrs, the listen and announce addresses, ``--tls``;
- the addresses the node will listen on (``--listen``, ``--dht-listen``, ``--metrics-port``):
  each bindable now (``protocol.swarm.ports``: a probe binds and closes, never listens) and each
  fixed port the node's own once (a probe is a question, not a reservation: the servers' own bind
  errors are one-line errors too, ``node/swarm/setup.py``);
- the run directory (``--run-dir``): created and writable;
- the data: the tokenizer (``--tokenizer``), then the corpus (``--data``), loaded here once and
  handed to the trainer; and, when the run dir holds a checkpoint to resume, that it was trained
  with this tokenizer (checked before the corpus is tokenized with another), on this corpus, and
  has this model's shapes (``--model`` / ``--model-config`` / ``--seq-len``).

:func:`run_warnings` lists settings that run but probably not as meant (e.g. a warm-up longer than
the whole run: the learning rate never reaches its peak).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.config import ConfigError, NodeConfig

if TYPE_CHECKING:
    from node.data.corpus import Corpus
    from node.data.tokenizer import Tokenizer
    from node.model.gpt import ModelConfig

log = logging.getLogger("dtnode")

MODEL_SHAPE_FIELDS = (
    "vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden_dim", "tie_embeddings",
)  # fmt: skip
"""The fields of a ``ModelConfig`` that decide its parameters' shapes: a checkpoint fits a model iff
they agree (``seq_len``, ``rope_theta`` … change no parameter, so a run may resume with others)."""


def run_length_steps(config: NodeConfig) -> int:
    """Inner steps the run ends at (``--max-steps``, ``--max-rounds`` x ``--inner-steps`` or its
    fragments' step, the smaller of the two when both are set); 0 when the run has no end."""
    limits = [limit for limit in (config.run.max_steps, config.rounds_end_step) if limit]
    return min(limits) if limits else 0


def run_warnings(config: NodeConfig) -> list[str]:
    """Settings that are valid but probably not meant, each as one sentence naming the flags."""
    warnings = []
    length = run_length_steps(config)
    if length and config.inner.warmup_steps > length:
        warnings.append(
            f"--warmup-steps {config.inner.warmup_steps} exceeds the run ({length} inner steps): the learning "
            f"rate never reaches --inner-lr {config.inner.lr:g}; lower --warmup-steps"
        )
    return warnings


def check_before_sockets(config: NodeConfig) -> tuple[Tokenizer, Corpus]:
    """Raise ConfigError (naming the flag) for a setting that cannot work; log :func:`run_warnings`.
    Returns the tokenizer and corpus it loaded, for the trainer (``Trainer(corpus=…)``)."""
    # Imported here: the layout pulls in torch, the swarm side hivemind (slow; --help stays instant).
    from node.data.node_corpus import load_node_corpus, node_tokenizer
    from node.model.gpt import model_config
    from node.outer.fragments import fragment_schedule
    from node.parallel.layout import resolve_layout
    from node.train.checkpoint import checkpoint_meta, latest_checkpoint
    from node.train.trainer import pick_device

    pick_device(config.run.device)  # --device cuda without a CUDA device

    try:
        architecture = config.architecture
        seq_len = {"seq_len": architecture.seq_len} if architecture.seq_len else {}
        model = model_config(architecture.preset, **seq_len)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    resolve_layout(config, model)  # raises ConfigError naming the flags
    fragment_schedule(config)  # --fragments with the settings it cannot run with
    if config.network.enabled:
        check_swarm_settings(config)
    check_listen_addresses(config)
    check_run_dir(config.resolved_run_dir)

    tokenizer = node_tokenizer(config)
    latest = latest_checkpoint(config.resolved_run_dir / "checkpoints")
    meta = None if latest is None else checkpoint_meta(latest)
    if latest is not None and meta is not None:  # before the corpus is tokenized with another tokenizer
        check_resumed_tokenizer(latest, meta, tokenizer.sha256)
    tokenizer, corpus = load_node_corpus(config, tokenizer)
    from node.model.hf import node_model

    trained = node_model(config, corpus.vocab_size)  # ConfigError: a --model-config that does not fit
    if latest is not None and meta is not None:
        check_resumed_corpus(latest, meta, corpus)
        check_resumed_model(latest, meta, trained, config)
    for warning in run_warnings(config):  # a start that is refused says one line: the refusal
        log.warning("%s", warning)
    return tokenizer, corpus


# --- the swarm side's settings ---


@contextlib.contextmanager
def _flag(flag: str) -> Iterator[None]:
    """A ValueError raised inside becomes a ConfigError that names ``flag`` (unless it names one first)."""
    try:
        yield
    except ValueError as error:
        message = str(error)
        raise ConfigError(message if message.startswith("--") else f"{flag}: {message}") from None


def check_swarm_settings(config: NodeConfig) -> None:
    """The key file, the identity file, the peers, then the rest of the swarm side's settings, each
    refusal naming its flag."""
    from node.swarm.setup import dht_config, swarm_config, swarm_key
    from protocol.discovery.addresses import check_peer_multiaddr
    from protocol.discovery.identity import check_identity_path

    with _flag("--swarm-key-file"):
        swarm_key(config)  # missing, unreadable, open to others or weak
    with _flag("--identity-path"):
        if config.security.identity_path:
            check_identity_path(Path(config.security.identity_path))
    with _flag("--peers"):
        for address in config.network.peers.split(","):
            if address.strip():
                check_peer_multiaddr(address.strip())
    with _flag("--dht-listen"):
        dht_config(config)
    swarm_config(config)  # ConfigError for the rest


# --- the addresses the node listens on ---


def listen_addresses(config: NodeConfig) -> list[tuple[str, str, int]]:
    """``(flag, host, port)`` of every TCP address the node will listen on (port 0: any free one): the
    gRPC server and the DHT peer (none in client mode: it accepts no connections) and the metrics
    endpoint."""
    from node.swarm.setup import dht_listen
    from protocol.discovery.addresses import parse_host_port

    addresses: list[tuple[str, str, int]] = []
    network = config.network
    if network.enabled and not network.client_mode:
        # An empty host stays empty: bind_problem probes it as every interface, and names it as written.
        with _flag("--listen"):
            addresses.append(("--listen", *parse_host_port(network.listen, flag="--listen", empty_host="")))
        with _flag("--dht-listen"):
            listen = dht_listen(network)
            addresses.append(("--dht-listen", *parse_host_port(listen, flag="--dht-listen", empty_host="")))
    if config.metrics.port:
        addresses.append(("--metrics-port", config.metrics.listen.strip("[]"), config.metrics.port))
    return addresses


def check_listen_addresses(config: NodeConfig) -> None:
    """Each listen address bindable now, and each fixed port used once; else ConfigError naming the flag."""
    from protocol.swarm.ports import bind_problem, shared_port

    addresses = listen_addresses(config)
    shared = shared_port(addresses)
    if shared is not None:
        first, second = shared
        port = next(port for flag, _, port in addresses if flag == second)
        raise ConfigError(f"{second}: port {port} is {first}'s too; give each its own port (0: any free one)")
    for flag, host, port in addresses:
        problem = bind_problem(host, port)
        if problem is not None:
            raise ConfigError(f"{flag}: cannot listen on {host}:{port}: {problem}")


# --- the run directory ---


def check_run_dir(run_dir: Path) -> None:
    """The run directory exists (made now) and a file can be written in it."""
    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or str(error)
        raise ConfigError(f"--run-dir: cannot write to {run_dir}: {reason}") from None


# --- the checkpoint a run resumes from ---


def _resume_advice(what: str) -> str:
    return f"resume with the {what} it was trained with, or give a new --run-dir"


def _tokenizer_text(sha256: str | None) -> str:
    return "byte tokens (no --tokenizer)" if sha256 is None else f"tokenizer {sha256[:12]}"


def _recorded_tokenizer(checkpoint: Path, meta: dict[str, Any]) -> tuple[bool, str | None]:
    """(known, the tokenizer's sha256 or None for byte tokens) of the checkpoint: its meta's, else the
    run dir's ``corpus.txt`` (written at each start once the checkpoint resumed: checkpoints written
    before the meta held it)."""
    if "tokenizer_sha256" in meta:
        return True, meta["tokenizer_sha256"]
    record = checkpoint.parent.parent / "corpus.txt"
    with contextlib.suppress(OSError):
        for line in record.read_text().splitlines():
            key, _, value = line.partition(" = ")
            if key == "tokenizer_sha256":
                return True, None if value.startswith("none") else value
    return False, None


def check_resumed_tokenizer(checkpoint: Path, meta: dict[str, Any], sha256: str | None) -> None:
    """The run resumes ``checkpoint``: it was trained with the tokenizer of digest ``sha256`` (None:
    byte tokens), if its record says which it was; else ConfigError naming ``--tokenizer``."""
    known, trained = _recorded_tokenizer(checkpoint, meta)
    if known and trained != sha256:
        raise ConfigError(
            f"--tokenizer: the run dir's checkpoint {checkpoint.name} was trained with {_tokenizer_text(trained)}, "
            f"this run tokenizes with {_tokenizer_text(sha256)}; {_resume_advice('tokenizer')}"
        )


def check_resumed_corpus(checkpoint: Path, meta: dict[str, Any], corpus: Corpus) -> None:
    """``checkpoint`` was trained on ``corpus`` (the digest of its tokens); else ConfigError naming ``--data``."""
    trained = meta.get("corpus_sha256")
    if trained is not None and trained != corpus.sha256:
        known, _ = _recorded_tokenizer(checkpoint, meta)
        flags = "--data" if known else "--data (or --tokenizer)"
        raise ConfigError(
            f"{flags}: the run dir's checkpoint {checkpoint.name} was trained on corpus {trained[:12]}, this run "
            f"reads {corpus.sha256[:12]} ({corpus.description}); {_resume_advice('data')}"
        )


def check_resumed_model(
    checkpoint: Path, meta: dict[str, Any], model: ModelConfig, config: NodeConfig
) -> None:
    """``checkpoint`` holds parameters of ``model``'s shapes; else ConfigError naming the model's flag."""
    architecture = config.architecture
    flag = (
        "--model-config" if architecture.hf_config else "--init-from" if architecture.init_from else "--model"
    )
    stored = meta.get("model_config")
    if isinstance(stored, dict):
        ours = dataclasses.asdict(model)
        differ = [name for name in MODEL_SHAPE_FIELDS if name in stored and stored[name] != ours[name]]
        if not differ:
            return
        if differ == ["vocab_size"]:
            flag = "--tokenizer"
        trained = ", ".join(f"{name} {stored[name]}" for name in differ)
        built = ", ".join(f"{name} {ours[name]}" for name in differ)
        raise ConfigError(
            f"{flag}: the run dir's checkpoint {checkpoint.name} holds a model of {trained}, this run builds "
            f"{built}; {_resume_advice('model')}"
        )
    # A checkpoint written before its meta held the model's shapes: its preset's name, if one was used.
    if flag == "--model" and meta.get("model") not in (None, architecture.preset):
        raise ConfigError(
            f"--model: the run dir's checkpoint {checkpoint.name} holds model {meta['model']!r}, this run "
            f"builds {architecture.preset!r}; {_resume_advice('model')}"
        )
