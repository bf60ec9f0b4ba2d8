"""Checks ``dtnode join`` runs after reading its settings and before it opens any socket.

A setting that cannot work must end the start with one line and exit code 2 (``ConfigError``)
before the DHT and the gRPC server start and the join banner is printed: otherwise the user reads
"started a new swarm … to join it" followed by an error, and peers may already have seen the node.
:func:`check_before_sockets` runs what can be checked without the corpus or the model's weights:

- the device (``--device cuda`` needs one);
- the intra-node layout (``--local-workers``, ``--dp/--tp/--pp``, micro-batches, the planner),
  resolved exactly as the trainer will resolve it (``node.parallel.layout.resolve_layout``) for
  the ``--model`` preset (the layout's rules read heads, layers and the batch, not the vocabulary);
- the swarm side's settings (``node.swarm.setup.swarm_config``): the swarm key file, ``--tls``,
  the ``--peers`` multiaddrs and listen addresses, and the ``--identity-path`` folder.

:func:`run_warnings` lists settings that run but probably not as meant (e.g. a warm-up longer than
the whole run: the learning rate never reaches its peak).
"""

from __future__ import annotations

import logging

from node.config import ConfigError, NodeConfig

log = logging.getLogger("dtnode")


def run_length_steps(config: NodeConfig) -> int:
    """Inner steps the run ends at (``--max-steps``, ``--max-rounds`` x ``--inner-steps``, the
    smaller of the two when both are set); 0 when the run has no end."""
    limits = [limit for limit in (config.run.max_steps, config.run.max_rounds * config.inner.steps) if limit]
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


def check_before_sockets(config: NodeConfig) -> None:
    """Raise ConfigError for a layout or swarm setting that cannot work; log :func:`run_warnings`."""
    for warning in run_warnings(config):
        log.warning("%s", warning)
    # Imported here: the layout pulls in torch, the swarm side hivemind (slow; --help stays instant).
    from node.model.gpt import model_config
    from node.parallel.layout import resolve_layout
    from node.train.trainer import pick_device

    pick_device(config.run.device)  # --device cuda without a CUDA device

    try:
        architecture = config.architecture
        seq_len = {"seq_len": architecture.seq_len} if architecture.seq_len else {}
        model = model_config(architecture.preset, **seq_len)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    resolve_layout(config, model)  # raises ConfigError naming the flags
    if config.network.enabled:
        from node.swarm.setup import swarm_config

        swarm_config(config)  # raises ConfigError (the key file, addresses, identity path)
