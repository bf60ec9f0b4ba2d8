"""Publishing a snapshot, which a node does every round, logs at DEBUG only (not in INFO logs)."""

from __future__ import annotations

import logging

import pytest
import torch

from protocol.statesync import Snapshot, StateProvider, StateSyncConfig


def test_publishing_a_snapshot_logs_nothing_at_info(caplog: pytest.LogCaptureFixture) -> None:
    provider = StateProvider(StateSyncConfig())
    snapshot = Snapshot(round_id=1, state_id="s1", tensors={"global_params": torch.zeros(8)}, metadata={})
    with caplog.at_level(logging.DEBUG, logger="protocol.statesync"):
        provider.publish(snapshot)
    serving = [record for record in caplog.records if "serving" in record.getMessage()]
    assert serving and all(record.levelno == logging.DEBUG for record in serving)
    assert not [record for record in caplog.records if record.levelno >= logging.INFO]
