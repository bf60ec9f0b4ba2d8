"""Error feedback: the residual is exactly what the codec lost, and it makes running averages converge."""

from __future__ import annotations

import pytest
import torch

from protocol.codecs import get_codec
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
