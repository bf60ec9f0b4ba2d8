"""The hivemind baseline worker: two real peers on loopback agree with torch's exact mean.

The silent-failure detector is tested on hand-built vectors, since hivemind only fails silently
under library versions we do not install.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.scripts.script_loader import load_script, script_path

hivemind_worker = load_script("hivemind_worker")
allreduce_worker = load_script("allreduce_worker")


def hand_seeded_vector(seed: int, index: int, vector_round: int, num_elements: int) -> torch.Tensor:
    """The shared rule written out by hand: 2^20-number blocks, each seeded from sha256("s:i:r:block")."""
    blocks = []
    for block, start in enumerate(range(0, num_elements, 1 << 20)):
        digest = hashlib.sha256(f"{seed}:{index}:{vector_round}:{block}".encode()).digest()
        block_seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
        size = min(1 << 20, num_elements - start)
        blocks.append(torch.randn(size, generator=torch.Generator().manual_seed(block_seed)))
    return torch.cat(blocks)


def test_peer_vector_is_the_dtnode_workers_vector() -> None:
    # Both baselines must average bit-identical inputs; 1.5M numbers span two generation blocks.
    num_elements = 1_500_000
    vector = hivemind_worker.make_peer_vector(7, 3, 2, num_elements)
    torch.testing.assert_close(vector, hand_seeded_vector(7, 3, 2, num_elements), rtol=0, atol=0)
    torch.testing.assert_close(vector, allreduce_worker.make_vector(7, 3, 2, num_elements), rtol=0, atol=0)
    assert not torch.equal(vector, hivemind_worker.make_peer_vector(7, 4, 2, num_elements))
    assert not torch.equal(vector, hivemind_worker.make_peer_vector(7, 3, 1, num_elements))


def test_blockwise_exact_mean_equals_torch_mean_of_the_stacked_vectors() -> None:
    num_elements = 1_300_000  # a full block and a partial one
    vectors = torch.stack([hand_seeded_vector(4, i, 1, num_elements) for i in range(3)])
    expected = vectors.mean(dim=0)
    torch.testing.assert_close(hivemind_worker.exact_mean(4, 3, 1, num_elements), expected, rtol=0, atol=0)


def test_averaging_check_accepts_the_mean_and_codec_noise_but_not_leftovers() -> None:
    own = hivemind_worker.make_peer_vector(0, 0, 0, 10_000)
    reference = hivemind_worker.exact_mean(0, 2, 0, 10_000)
    spread = (own - reference).abs().mean()
    assert hivemind_worker.is_really_averaged(reference.clone(), own, reference)
    noisy = reference + 0.05 * spread * torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    assert hivemind_worker.is_really_averaged(noisy, own, reference)  # like int8 quantization error
    assert not hivemind_worker.is_really_averaged(own.clone(), own, reference)  # nothing averaged
    partial = reference.clone()
    partial[5_000:] = own[5_000:]  # one peer's half of the butterfly all-reduce failed
    assert not hivemind_worker.is_really_averaged(partial, own, reference)
    tiny_leftover = reference.clone()
    tiny_leftover[:100] = own[:100]  # 1% of the vector left un-averaged
    assert not hivemind_worker.is_really_averaged(tiny_leftover, own, reference)


def test_config_rejects_user_mistakes(tmp_path: Path) -> None:
    base = ["--num-peers", "2", "--elements", "10", "--rendezvous", str(tmp_path)]
    for bad in (
        ["--index", "2"],
        ["--index", "0", "--num-peers", "1"],
        ["--index", "0", "--elements", "0"],
        ["--index", "0", "--vector-round", "-1"],
    ):
        with pytest.raises(ValueError):
            hivemind_worker.parse_args([*base, *bad])


@pytest.mark.timeout(150)
def test_two_peers_on_loopback_average_exactly(tmp_path: Path) -> None:
    num_elements, seed = 10_000, 5
    rendezvous = tmp_path / "rendezvous"
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                str(script_path("hivemind_worker")),
                *["--index", str(index), "--num-peers", "2", "--elements", str(num_elements)],
                *["--codec", "none", "--seed", str(seed), "--vector-round", "1"],
                *["--rendezvous", str(rendezvous)],
                *[
                    "--host",
                    "127.0.0.1",
                    "--timeout",
                    "120",
                    "--save-result",
                    str(tmp_path / f"result_{index}.pt"),
                ],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for index in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=140)[0] for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    assert [worker.returncode for worker in workers] == [0, 0]

    # Independent reference, built here from the seeding rule.
    vectors = [hand_seeded_vector(seed, i, 1, num_elements) for i in range(2)]
    expected = torch.stack(vectors).mean(dim=0)
    for index, output in enumerate(outputs):
        report = json.loads(output.strip().splitlines()[-1])
        assert report["index"] == index and report["error"] is None
        assert report["averaged_ok"] and report["group_size"] == 2
        assert report["max_abs_error"] < 1e-5
        assert report["seconds"] > 0 and report["peak_rss_bytes"] >= report["baseline_rss_bytes"] > 0
        result = torch.load(tmp_path / f"result_{index}.pt")
        torch.testing.assert_close(result, expected, rtol=0, atol=1e-5)
