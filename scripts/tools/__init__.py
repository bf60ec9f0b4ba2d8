"""Tools to break and stress a swarm: the WAN emulator, chaos, RPC fuzzing, checkpoint crashes."""
