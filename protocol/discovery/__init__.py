"""Peer discovery: a hivemind DHT peer and the run's registry of peer records on it.

- ``addresses``: ``--listen`` / ``--announce`` ``HOST:PORT`` and ``--peers`` multiaddrs, validated.
- ``dht_node``: :class:`DhtNode`, a DHT peer confined to the given addresses, every call with a deadline.
- ``registry``: :class:`SwarmRegistry`, this peer's :class:`~protocol.membership.records.PeerRecord`
  kept alive by a heartbeat, a tombstone on leave, and the :class:`SwarmView` of everyone's records.

The package imports none of them: ``addresses`` splits ``HOST:PORT`` for the node's configuration and
the peer records, which must not load hivemind (nor, through ``registry``, import the records back).
"""
