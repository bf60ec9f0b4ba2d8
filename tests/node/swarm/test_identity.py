"""A node's identity digest (node/swarm/state.py ``run_identity``): what its DHT record says it trains.
Nodes of one identity can average; the digest must tell apart what they cannot (another architecture
of the same size, other data) and not what a swarm reconciles itself (the init, the context length)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from node.api import module_shapes
from node.model.gpt import model_config
from node.swarm.state import run_identity

DATA = "c" * 64


def identity(architecture: str, *, data: str = DATA, num_elements: int = 1000) -> str:
    return run_identity(
        model="nano", architecture=architecture, num_elements=num_elements, corpus_sha256=data
    )


def test_the_identity_names_the_shapes_and_the_data_but_not_the_init_or_context_length() -> None:
    base = model_config("nano")
    ours = identity(base.architecture())
    assert len(ours) == 64 and ours == identity(base.architecture())
    # The same shapes: another init scale or a longer RoPE table still average together.
    assert ours == identity(replace(base, init_std=0.5, seq_len=2 * base.seq_len).architecture())
    # Same size, other model: another RoPE base changes no shape, but every step; other data.
    assert ours != identity(replace(base, rope_theta=5e5).architecture())
    assert ours != identity(base.architecture(), data="d" * 64)


def test_an_api_modules_identity_follows_its_parameter_shapes() -> None:
    """Two modules of the same size (31 numbers), whose flat vectors would line up, but other shapes."""
    first = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3))
    second = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 4))
    assert sum(p.numel() for p in first.parameters()) == sum(p.numel() for p in second.parameters()) == 31
    assert module_shapes(first) == "0.weight:(4, 3);0.bias:(4,);1.weight:(3, 4);1.bias:(3,)"
    assert identity(module_shapes(first), num_elements=31) != identity(module_shapes(second), num_elements=31)
