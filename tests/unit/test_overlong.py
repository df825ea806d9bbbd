"""DAPO's soft overlong punishment, against its formula written out independently."""

import pytest

from entropy_openrlhf.actors.reward import verifier_items
from entropy_openrlhf.algorithms.overlong import overlong_penalty
from entropy_openrlhf.samples import Sample


def dapo(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    # DAPO eq. (13): R_length(y) = 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache * factor up to L_max
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    return (expected - length) / buffer_len * factor


@pytest.mark.parametrize("max_len, buffer_len, factor", [(128, 32, 1.0), (20480, 4096, 1.0), (64, 64, 0.5)])
def test_the_penalty_is_the_formula_at_every_length(max_len, buffer_len, factor):
    for length in range(0, max_len + 1, max(1, max_len // 97)):
        assert overlong_penalty(length, max_len, buffer_len, factor) == pytest.approx(
            dapo(length, max_len, buffer_len, factor), abs=1e-12
        )
    assert overlong_penalty(max_len, max_len, buffer_len, factor) == pytest.approx(-factor)
    assert overlong_penalty(max_len - buffer_len, max_len, buffer_len, factor) == 0.0


def test_off_and_bad_buffers():
    assert overlong_penalty(128, 128, 0, 1.0) == 0.0  # buffer 0: off
    assert overlong_penalty(128, 128, 16, 0.0) == 0.0
    with pytest.raises(ValueError, match="overlong buffer 200 must be in"):
        overlong_penalty(10, 128, 200, 1.0)


def test_a_verifier_is_told_the_response_length_why_it_ended_and_its_data_source():
    cut = Sample(3, "p", [1], "12 + 5 = 1", [9, 9, 9], [0.0] * 3, "17", 0, finish_reason="length", metadata={"k": 1},
                 data_source="gsm8k")  # fmt: skip
    ((response, label, prompt, metadata),) = verifier_items([cut])
    assert (response, label, prompt) == ("12 + 5 = 1", "17", "p")
    assert metadata == {"k": 1, "data_source": "gsm8k", "response_tokens": 3, "finish_reason": "length"}
    assert cut.metadata == {"k": 1}  # the sample's own metadata is not changed
