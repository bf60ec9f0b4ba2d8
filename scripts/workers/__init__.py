"""Peer processes that benchmarks and tests start: one all-reduce peer each (dtnode or hivemind)."""
