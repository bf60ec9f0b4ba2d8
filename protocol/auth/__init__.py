"""Swarm membership by a shared key: key files, signed gRPC calls, mutual TLS, signed DHT records.

``key.py`` loads and writes the key; ``grpc_auth.py`` signs and checks each gRPC call; ``tls.py``
derives the swarm's certificate authority from the key; ``channels.py`` makes every channel and
server of the swarm with those (``SwarmAuth``); ``dht.py`` signs and checks DHT records.
"""

from protocol.auth.channels import SwarmAuth, add_port, new_server, open_channel
from protocol.auth.grpc_auth import REFUSAL, client_interceptors, server_interceptors
from protocol.auth.key import SwarmKey, SwarmKeyError

OPEN_SWARM_WARNING = (
    "swarm is open: anyone who can reach this node can join; use --swarm-key-file "
    "(make a key with `dtnode keygen PATH`)"
)

__all__ = [
    "OPEN_SWARM_WARNING",
    "REFUSAL",
    "SwarmAuth",
    "SwarmKey",
    "SwarmKeyError",
    "add_port",
    "client_interceptors",
    "new_server",
    "open_channel",
    "server_interceptors",
]
