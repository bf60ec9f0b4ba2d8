"""Tests of sharded, resumable training batches and of the fixed validation batches.

Most tests use the stream 0, 1, 2, ... so a batch row's first token identifies its window
(``x[:, 0] // seq_len``) and the expected x/y follow by hand from the window layout.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from node.data.batches import ShardedBatches, eval_batches, load_corpus, window_permutation

SEQ_LEN = 8
BATCH_SIZE = 3
NUM_SHARDS = 4
NUM_WINDOWS = 60  # five full rounds of NUM_SHARDS * BATCH_SIZE = 12 windows


def _counting_stream(num_windows: int, seq_len: int = SEQ_LEN, extra: int = 0) -> np.ndarray:
    return np.arange(num_windows * seq_len + 1 + extra, dtype=np.uint16)


def _loader(
    tokens: np.ndarray, *, seed: int = 7, shard_index: int = 0, num_shards: int = NUM_SHARDS
) -> ShardedBatches:
    return ShardedBatches(
        tokens,
        seq_len=SEQ_LEN,
        batch_size=BATCH_SIZE,
        seed=seed,
        shard_index=shard_index,
        num_shards=num_shards,
    )


def _windows_of(x: torch.Tensor) -> list[int]:
    return (x[:, 0] // SEQ_LEN).tolist()


def test_x_y_are_shifted_windows_of_the_raw_stream(tmp_path: Path) -> None:
    path = tmp_path / "input.txt"
    path.write_text("".join(chr(32 + i % 90) for i in range(5_000)), encoding="utf-8")
    tokens = load_corpus(str(path), val_fraction=0.1).train
    loader = ShardedBatches(tokens, seq_len=16, batch_size=4, seed=1, shard_index=1, num_shards=2)
    num_windows = (tokens.size - 1) // 16
    served = loader.window_indices(0)
    for batch_windows in served[:3]:
        x, y = loader.next_batch()
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 16)
        for row, window in enumerate(batch_windows.tolist()):
            assert 0 <= window < num_windows
            raw = torch.from_numpy(tokens[window * 16 : window * 16 + 17].astype(np.int64))
            assert torch.equal(x[row], raw[:-1]) and torch.equal(y[row], raw[1:])


def test_window_permutation_is_a_seeded_permutation() -> None:
    order = window_permutation(1_000, seed=3, epoch=0)
    assert np.array_equal(np.sort(order), np.arange(1_000))
    assert np.array_equal(order, window_permutation(1_000, seed=3, epoch=0))
    assert not np.array_equal(order, window_permutation(1_000, seed=3, epoch=1))
    assert not np.array_equal(order, window_permutation(1_000, seed=4, epoch=0))
    with pytest.raises(ValueError, match="seed"):
        window_permutation(10, seed=-1, epoch=0)


def test_shards_partition_the_epoch() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    served: list[list[int]] = []
    for shard_index in range(NUM_SHARDS):
        loader = _loader(tokens, shard_index=shard_index)
        assert loader.batches_per_epoch == 5
        windows = []
        for _ in range(loader.batches_per_epoch):
            x, y = loader.next_batch()
            assert torch.equal(y, x + 1)  # consecutive stream: the target is the next integer
            windows += _windows_of(x)
        assert windows == loader.window_indices(0).reshape(-1).tolist()
        assert loader.state_dict()["epoch"] == 0
        served.append(windows)
    for first, second in itertools.combinations(served, 2):
        assert not set(first) & set(second)
    assert sorted(itertools.chain.from_iterable(served)) == list(range(NUM_WINDOWS))
    # The brief's rule: with no reshard, shard i reads permutation positions p with p % n == i.
    order = window_permutation(NUM_WINDOWS, seed=7, epoch=0)
    for shard_index, windows in enumerate(served):
        assert windows == order[shard_index::NUM_SHARDS].tolist()


def test_partial_last_round_is_skipped_and_the_next_epoch_reshuffles() -> None:
    tokens = _counting_stream(NUM_WINDOWS + 5)  # 65 windows: five rounds of 12 and a tail of 5
    loaders = [_loader(tokens, shard_index=index) for index in range(NUM_SHARDS)]
    epochs: list[list[int]] = [[], []]
    for epoch in range(2):
        for loader in loaders:
            for _ in range(loaders[0].batches_per_epoch):
                epochs[epoch] += _windows_of(loader.next_batch()[0])
            assert loader.state_dict()["epoch"] == epoch
    for windows in epochs:
        assert len(windows) == len(set(windows)) == NUM_WINDOWS
        assert set(windows) <= set(range(NUM_WINDOWS + 5))
    assert epochs[0] != epochs[1]


def test_same_seed_same_batches_different_seed_different() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    first, second, other = _loader(tokens, seed=11), _loader(tokens, seed=11), _loader(tokens, seed=12)
    different = False
    for _ in range(12):  # more than two epochs
        x_first, y_first = first.next_batch()
        x_second, y_second = second.next_batch()
        x_other, _ = other.next_batch()
        assert torch.equal(x_first, x_second) and torch.equal(y_first, y_second)
        different |= not torch.equal(x_first, x_other)
    assert different


def test_resume_from_state_yields_the_uninterrupted_batches() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    uninterrupted = _loader(tokens, seed=5, shard_index=2)
    for _ in range(7):  # crosses the epoch boundary after 5 batches
        uninterrupted.next_batch()
    state = uninterrupted.state_dict()
    assert state == {
        "epoch": 1, "position": 24, "seed": 5, "shard_index": 2, "num_shards": 4, "seq_len": 8,
        "phase_epoch": 0, "phase_position": 0, "phase_reads": 7,  # where its phase started (end_round)
    }  # fmt: skip

    resumed = _loader(tokens, seed=999, shard_index=0, num_shards=1)  # everything comes from the state
    resumed.load_state_dict(dict(state))
    for _ in range(6):
        x_expected, y_expected = uninterrupted.next_batch()
        x_resumed, y_resumed = resumed.next_batch()
        assert torch.equal(x_expected, x_resumed) and torch.equal(y_expected, y_resumed)
    assert resumed.state_dict() == uninterrupted.state_dict()

    with pytest.raises(ValueError, match="seq_len"):
        ShardedBatches(tokens, seq_len=4, batch_size=3, seed=5).load_state_dict(state)


def test_reshard_keeps_live_peers_disjoint_for_the_rest_of_the_epoch() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    peers = [_loader(tokens, shard_index=index) for index in range(NUM_SHARDS)]
    read: list[int] = []
    for _ in range(2):  # two rounds with four peers: 24 windows
        for peer in peers:
            read += _windows_of(peer.next_batch()[0])
    survivors = peers[:3]  # the fourth peer leaves; the survivors agree on the global position
    for new_index, peer in enumerate(survivors):
        peer.reshard(new_index, 3)
        assert peer.state_dict()["position"] == 24
    after: list[list[int]] = [[] for _ in survivors]
    for _ in range(4):  # the remaining 36 windows make exactly four rounds of 3 * 3
        for new_index, peer in enumerate(survivors):
            after[new_index] += _windows_of(peer.next_batch()[0])
    for first, second in itertools.combinations(after, 2):
        assert not set(first) & set(second)
    everything = read + list(itertools.chain.from_iterable(after))
    assert sorted(everything) == list(range(NUM_WINDOWS))  # nothing read twice, nothing skipped
    assert all(peer.state_dict()["epoch"] == 0 for peer in survivors)


def test_invalid_sharding_raises_value_error() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    loader = _loader(tokens)
    with pytest.raises(ValueError, match="shard_index"):
        loader.reshard(4, 4)
    with pytest.raises(ValueError, match="fewer than num_shards"):
        loader.reshard(0, 21)  # 21 * 3 = 63 > 60 windows
    with pytest.raises(ValueError, match="fewer than num_shards"):
        ShardedBatches(_counting_stream(2), seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=0)


def test_eval_batches_are_fixed_and_evenly_spread() -> None:
    val = _counting_stream(100)
    first = eval_batches(val, SEQ_LEN, 4, 5)
    second = eval_batches(val, SEQ_LEN, 4, 5)
    assert len(first) == 5
    for (x_first, y_first), (x_second, y_second) in zip(first, second, strict=True):
        assert x_first.shape == (4, SEQ_LEN) and x_first.dtype == torch.int64
        assert torch.equal(x_first, x_second) and torch.equal(y_first, y_second)
        assert torch.equal(y_first, x_first + 1)
    windows = [window for x, _ in first for window in _windows_of(x)]
    assert windows == [index * 100 // 20 for index in range(20)]  # 0, 5, 10, ..., 95


def test_eval_batches_on_a_short_stream() -> None:
    assert len(eval_batches(_counting_stream(10), SEQ_LEN, 4, 5)) == 2  # 10 windows: two full batches
    (only,) = eval_batches(_counting_stream(2), SEQ_LEN, 4, 5)  # fewer windows than a batch
    assert only[0].shape == (2, SEQ_LEN)
    with pytest.raises(ValueError, match="seq_len"):
        eval_batches(np.arange(SEQ_LEN, dtype=np.uint16), SEQ_LEN, 4, 5)


def _by_hand(permutation: np.ndarray, positions: range | list[int]) -> list[int]:
    return [int(permutation[p % NUM_WINDOWS]) for p in positions]


@pytest.mark.timeout(30)
def test_a_spare_lane_reads_the_positions_behind_its_round_in_lockstep() -> None:
    """Spare lane j of a round starting at position P (phases of H steps, n shards of B) reads the
    H*B positions P - (j+1)*H*B .. P - j*H*B - 1, B at a time, while its position advances by n*B."""
    tokens = _counting_stream(NUM_WINDOWS)
    num_shards, steps = 2, 2  # a round reads 2 * 2 * 3 = 12 positions, a spare lane 6
    members = [_loader(tokens, shard_index=index, num_shards=num_shards) for index in range(num_shards)]
    spares = [_loader(tokens, shard_index=0, num_shards=num_shards) for _ in range(2)]
    for loader in (*members, *spares):
        loader.skip(2)  # the round starts at position 12
    for lane, spare in enumerate(spares):
        spare.read_spare(lane, steps=steps)
        assert spare.lane == (num_shards + lane, num_shards)
    permutation = window_permutation(NUM_WINDOWS, seed=7, epoch=0)
    read = {name: [] for name in ("member-0", "member-1", "spare-0", "spare-1")}
    for _ in range(steps):
        for index, member in enumerate(members):
            read[f"member-{index}"] += _windows_of(member.next_batch()[0])
        for lane, spare in enumerate(spares):
            read[f"spare-{lane}"] += _windows_of(spare.next_batch()[0])
    assert read["member-0"] + read["member-1"] == _by_hand(
        permutation, [*range(12, 24, 2), *range(13, 24, 2)]
    )
    assert read["spare-0"] == _by_hand(permutation, range(6, 12))  # just behind the round
    assert read["spare-1"] == _by_hand(permutation, range(0, 6))  # behind lane 0's
    for first, second in itertools.combinations(read.values(), 2):
        assert not set(first) & set(second)
    assert {loader.position for loader in (*members, *spares)} == {24}  # in lockstep
    # At the round's end every node reshards at the same position: the spare lane is over.
    spares[0].reshard(2, 3)
    assert spares[0].spare is None and spares[0].lane == (2, 3)
    assert "spare_lane" not in spares[0].state_dict()


@pytest.mark.timeout(30)
def test_a_spare_lane_at_an_epochs_start_reads_its_last_positions_and_resumes() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    spare = _loader(tokens, shard_index=0, num_shards=2)
    spare.read_spare(0, steps=3)  # a round from position 0 of epoch 0: lane 0 holds 9 positions
    permutation = window_permutation(NUM_WINDOWS, seed=7, epoch=0)
    first = _windows_of(spare.next_batch()[0])
    assert first == _by_hand(permutation, range(NUM_WINDOWS - 9, NUM_WINDOWS - 6))
    state = spare.state_dict()  # a checkpoint mid-lane: the lane comes along
    assert {k: state[k] for k in ("spare_lane", "spare_steps", "spare_epoch", "spare_anchor", "spare_reads")} == {
        "spare_lane": 0, "spare_steps": 3, "spare_epoch": 0, "spare_anchor": 0, "spare_reads": 1,
    }  # fmt: skip
    resumed = _loader(tokens)
    resumed.load_state_dict(state)
    rest = [_windows_of(loader.next_batch()[0]) for loader in (spare, resumed) for _ in range(3)]
    assert rest[:3] == rest[3:]
    # Steps 2 and 3 finish the lane; a fourth wraps within it (only this node reads it).
    assert rest[:3] == [
        _by_hand(permutation, range(NUM_WINDOWS - 6, NUM_WINDOWS - 3)),
        _by_hand(permutation, range(NUM_WINDOWS - 3, NUM_WINDOWS)),
        first,
    ]
    with pytest.raises(ValueError, match="lane >= 0"):
        spare.read_spare(-1, steps=3)


@pytest.mark.timeout(30)
def test_moving_to_another_spare_lane_keeps_the_rounds_start_and_step() -> None:
    tokens = _counting_stream(NUM_WINDOWS)
    spare = _loader(tokens, shard_index=0, num_shards=2)
    spare.skip(5)  # a round from position 30
    spare.read_spare(0, steps=2)
    permutation = window_permutation(NUM_WINDOWS, seed=7, epoch=0)
    assert _windows_of(spare.next_batch()[0]) == _by_hand(permutation, range(24, 27))  # lane 0, step 1
    spare.read_spare(1, steps=2)  # another node reads lane 0 too: move to lane 1 of the same round
    assert _windows_of(spare.next_batch()[0]) == _by_hand(permutation, range(21, 24))  # lane 1, step 2
    assert spare.lane == (3, 2) and spare.position == 30 + 2 * 2 * BATCH_SIZE


@pytest.mark.timeout(30)
def test_end_round_moves_members_of_any_count_and_steps_to_one_position_from_the_phase_start() -> None:
    """By hand: the agreed position is the phase's start moved by the group's most batches of the
    agreed shard count, with the epoch's wrap as reading would do it; a checkpoint mid-phase keeps
    where the phase started."""
    tokens = _counting_stream(NUM_WINDOWS)
    per_batch = BATCH_SIZE * SEQ_LEN
    fast, slow = _loader(tokens, num_shards=2), _loader(tokens, shard_index=1, num_shards=2)
    for loader in (fast, slow):
        loader.skip(3)  # the phase starts at position 18 of epoch 0 (the lineage's, the same on both)
        loader.reshard(loader.shard_index, 2)
    other_count = _loader(tokens, shard_index=2, num_shards=3)  # read the phase as 3 shards (a race)
    other_count.load_state_dict({**fast.state_dict(), "shard_index": 2, "num_shards": 3})
    for _ in range(4):
        fast.next_batch()
    slow.next_batch()
    other_count.next_batch()
    other_count.next_batch()
    assert {fast.position, slow.position, other_count.position} == {18 + 4 * 6, 18 + 6, 18 + 2 * 9}
    resumed = _loader(tokens)
    resumed.load_state_dict(slow.state_dict())  # a checkpoint mid-phase, resumed
    # The group: the fast member read 4 batches (its tokens say so), the phase counts as 2 shards.
    for loader, index in ((fast, 0), (slow, 1), (other_count, 2), (resumed, 1)):
        loader.end_round((index, 3), phase_shards=2, phase_tokens=4 * per_batch)
    # 18 + 4 * 6 = 42, and 42 + 6 > 60 is not reached: no wrap.
    assert {(loader.epoch, loader.position) for loader in (fast, slow, other_count, resumed)} == {(0, 42)}
    assert [loader.lane for loader in (fast, slow, other_count)] == [(0, 3), (1, 3), (2, 3)]
    # A phase that runs past the epoch's end wraps as reading does: 42 + 6 = 48, 54, 60, then epoch 1.
    fast.reshard(0, 2)  # (reshard: the phase starts here)
    fast.end_round((0, 2), phase_shards=None, phase_tokens=5 * per_batch)
    assert (fast.epoch, fast.position) == (1, 2 * 6)
    # Its own reads are a floor: a node that skipped its phase's rest.
    slow.skip(2)
    slow.end_round((1, 3), phase_shards=None, phase_tokens=1)
    assert slow.position == 42 + 2 * 9
    # A round without a group: our own position goes on, and the next phase starts from it.
    slow.next_batch()  # (60 + 9 > 60 windows: into epoch 1)
    assert "phase_reads" in slow.state_dict()
    slow.end_round(None)
    assert (slow.epoch, slow.position, slow.lane) == (1, 9, (1, 3)) and "phase_reads" not in slow.state_dict()
