"""Which snapshot a fetcher chooses from the manifests it got (pure; no sockets)."""

from __future__ import annotations

import pytest
import torch

from protocol.statesync import Snapshot, StateSyncError
from protocol.statesync.manifest import Manifest, parse_manifest, to_manifest
from protocol.statesync.sources import Source, choose_snapshot


def _manifest(state_id: str, round_id: int, seed: int = 0) -> Manifest:
    tensor = torch.randn(100, generator=torch.Generator().manual_seed(seed))
    snapshot = Snapshot(
        round_id=round_id, state_id=state_id, tensors={"p": tensor}, metadata=b"", block_bytes=64
    )
    return parse_manifest(to_manifest(snapshot, max_range_bytes=1 << 20, max_chunk_bytes=1 << 16))


def _sources(*manifests: Manifest | None) -> list[Source]:
    sources = [Source(f"peer{i}", stub=None, manifest=m) for i, m in enumerate(manifests)]  # type: ignore[arg-type]
    for source in sources:
        if source.manifest is None:
            source.excluded = "GetManifest: UNAVAILABLE"
    return sources


def test_expected_state_keeps_only_sources_serving_it() -> None:
    a, b = _manifest("A", 5), _manifest("B", 6, seed=1)
    sources = _sources(a, b, a, None)
    assert choose_snapshot(sources, "A") is a
    assert [s.excluded == "" for s in sources] == [True, False, True, False]


def test_without_expectation_the_newest_round_wins_then_the_majority() -> None:
    old, new, new_liar = _manifest("A", 5), _manifest("B", 6, seed=1), _manifest("B", 6, seed=2)
    sources = _sources(old, old, old, new, new, new_liar)
    chosen = choose_snapshot(sources, None)
    assert chosen is new
    assert [s.address for s in sources if not s.excluded] == ["peer3", "peer4"]
    assert "round 6 is newer" in sources[0].excluded and "disagrees" in sources[5].excluded


def test_a_tie_between_disagreeing_manifests_is_broken_the_same_way_everywhere() -> None:
    first, second = _manifest("B", 6, seed=1), _manifest("B", 6, seed=2)
    chosen_one = choose_snapshot(_sources(first, second), None)
    chosen_two = choose_snapshot(_sources(second, first), None)
    assert (
        chosen_one.content_digest
        == chosen_two.content_digest
        == min(first.content_digest, second.content_digest)
    )


def test_no_source_serving_the_expected_state_is_an_error_naming_each_source() -> None:
    with pytest.raises(StateSyncError, match=r"peer0: serves 'A'.*peer1: GetManifest: UNAVAILABLE"):
        choose_snapshot(_sources(_manifest("A", 5), None), "C")
