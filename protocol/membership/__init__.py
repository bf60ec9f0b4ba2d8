"""Swarm membership: peer records, lineage, round formation, all-reduce parts and data shards.

The state machines and functions are pure, with an injected clock: no sockets, no DHT. The daemon
(``protocol/swarm``) feeds them DHT snapshots and decoded messages and executes the actions they
return. Only ``wire`` and ``transport`` touch gRPC: they carry the messages between peers.

- ``records``: :class:`PeerRecord` (the DHT value, validated) and :class:`SwarmView` (live peers).
- ``lineage``: the canonical ``(round, param_hash)`` and who must re-sync to it.
- ``messages``: what peers say to form a round, and the :class:`GroupSpec` they agree on.
- ``rounds``: :class:`RoundFormation`, one per peer per round (its state, events and decisions,
  and the leader's and member's moves); ``actions``: what it asks for; ``proposals``: a leader's
  open proposal.
- ``parts``: the all-reduce part of each member, proportional to bandwidth.
- ``shards``: the data shard of each member.
- ``wire``: messages to and from protobuf (``protos/dtnode/v1/membership.proto``), validated;
  ``transport``: the ``Membership`` gRPC servicer and a client that sends one message per call.
"""
