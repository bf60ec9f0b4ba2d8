"""Error feedback: the residual is exactly what the codec lost, and it makes running averages converge."""

from __future__ import annotations

import pytest
import torch

from protocol.codecs import TopK2Codec, TopK4Codec, get_codec
from protocol.error_feedback import ErrorFeedback


def test_residual_is_what_the_codec_lost() -> None:
    codec = get_codec("int4")
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    feedback = ErrorFeedback(1500)
    feedback.residual[200:1200] = 0.01
    compensated = values + 0.01
    payload = feedback.encode(codec, values, offset=200)
    assert torch.equal(feedback.residual[200:1200], compensated - codec.decode(payload, 1000))
    assert torch.all(feedback.residual[:200] == 0) and torch.all(feedback.residual[1200:] == 0)


@pytest.mark.parametrize("name", ["int4", "int8", "bf16"])
def test_running_average_error_shrinks_with_feedback_only(name: str) -> None:
    """Sending the same vector R times: with feedback the mean of what arrived converges to it."""
    codec = get_codec(name)
    values = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    feedback = ErrorFeedback(values.numel())
    with_feedback, without = torch.zeros_like(values), torch.zeros_like(values)
    errors: list[float] = []
    for round_index in range(1, 21):
        with_feedback += codec.decode(feedback.encode(codec, values, 0), values.numel())
        without += codec.decode(codec.encode(values), values.numel())
        errors.append(float((with_feedback / round_index - values).abs().mean()))
    error_without = float((without / 20 - values).abs().mean())
    assert errors[-1] < errors[0] / 8
    assert error_without > errors[0] * 0.9  # without feedback the same error every round


def test_slice_outside_the_vector_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        ErrorFeedback(10).encode(get_codec("int8"), torch.zeros(5), offset=8)


def test_decayed_residual_matches_a_hand_computed_sparseloco_round() -> None:
    """β = 0.5: each round sends the top 2 of 8 of Δ + β · residual (SparseLoCo's error feedback).
    Two kept magnitudes per block are exactly the two levels of 2-bit top-k, so decode is exact
    and every number below is computed by hand."""
    codec = TopK2Codec(block_size=8, kept_per_block=2)
    feedback = ErrorFeedback(8, decay=0.5)
    first = torch.tensor([1.0, -5.0, 0.5, 3.0, 0.0, 0.25, -0.5, 2.0])
    sent = codec.decode(feedback.encode(codec, first, 0), 8)
    assert torch.equal(sent, torch.tensor([0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(feedback.residual, torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 0.25, -0.5, 2.0]))
    # compensated = second + 0.5 x residual = [0.5, 2, 0.25, 0, 4, 0.125, -0.25, 1]: sends 2 and 4.
    second = torch.tensor([0.0, 2.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0])
    sent = codec.decode(feedback.encode(codec, second, 0), 8)
    assert torch.equal(sent, torch.tensor([0.0, 2.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0]))
    assert torch.equal(feedback.residual, torch.tensor([0.5, 0.0, 0.25, 0.0, 0.0, 0.125, -0.25, 1.0]))


def test_decayed_residual_matches_a_hand_computed_4_bit_round() -> None:
    """β = 0.5, the top 3 of 8 with 4-bit values: with lo = 1 and hi = 8 the seven steps are 1 wide, so
    a middle value (4, then 3) decodes exactly, where 2-bit top-k would round it to 1 or 8."""
    codec = TopK4Codec(block_size=8, kept_per_block=3)
    feedback = ErrorFeedback(8, decay=0.5)
    first = torch.tensor([1.0, -8.0, 0.5, 4.0, 0.0, 0.25, -0.5, 0.75])
    sent = codec.decode(feedback.encode(codec, first, 0), 8)
    assert torch.equal(sent, torch.tensor([1.0, -8.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(feedback.residual, torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.25, -0.5, 0.75]))
    # compensated = second + 0.5 x residual = [0, 3, 0.25, 0, 8, 0.125, -0.25, 1]: sends 3, 8 and 1.
    second = torch.tensor([0.0, 3.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.625])
    sent = codec.decode(feedback.encode(codec, second, 0), 8)
    assert torch.equal(sent, torch.tensor([0.0, 3.0, 0.0, 0.0, 8.0, 0.0, 0.0, 1.0]))
    assert torch.equal(feedback.residual, torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0, 0.125, -0.25, 0.0]))


def test_decay_one_is_the_classic_rule_and_out_of_range_is_refused() -> None:
    codec = get_codec("int8")
    values = torch.randn(600, generator=torch.Generator().manual_seed(2))
    classic, decayed = ErrorFeedback(600), ErrorFeedback(600, decay=1.0)
    for _ in range(3):
        assert torch.equal(classic.encode(codec, values, 0), decayed.encode(codec, values, 0))
    assert torch.equal(classic.residual, decayed.residual)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="decay"):
            ErrorFeedback(4, decay=bad)
