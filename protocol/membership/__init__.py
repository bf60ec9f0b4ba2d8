"""Swarm membership: peer records, lineage, round formation, all-reduce parts and data shards.

Pure state machines and functions with an injected clock: no sockets, no DHT, no gRPC. The daemon
feeds them DHT snapshots and decoded messages and executes the actions they return.

- ``records``: :class:`PeerRecord` (the DHT value, validated) and :class:`SwarmView` (live peers).
- ``lineage``: the canonical ``(round, param_hash)`` and who must re-sync to it.
- ``messages``: what peers say to form a round, and the :class:`GroupSpec` they agree on.
- ``rounds``: :class:`RoundFormation`, one per peer per round; ``actions``: what it asks for;
  ``proposals``: a leader's open proposal.
- ``parts``: the all-reduce part of each member, proportional to bandwidth.
- ``shards``: the data shard of each member.
"""
