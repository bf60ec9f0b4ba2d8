"""The daemon's meeting point with the swarm: one gRPC server, the DHT, round formation, all-reduce
and state sync behind one synchronous facade (:class:`protocol.swarm.node.SwarmNode`)."""
