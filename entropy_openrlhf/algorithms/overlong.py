"""DAPO's soft overlong punishment: a reward penalty that grows linearly over the last tokens before the limit.

A response of L tokens, under a limit of L_max (`--rollout.max_new_tokens`) with a buffer of L_buf tokens
(`--reward.overlong_buffer_len`) and a factor f (`--reward.overlong_penalty_factor`), gets

    penalty(L) = 0                                    when L <= L_max - L_buf
               = -f * (L - (L_max - L_buf)) / L_buf   when L_max - L_buf < L <= L_max

added to the verifier's reward: -f at the limit itself. It tells the policy that running long costs something
before the hard cut does, without the all-or-nothing signal of a truncated response scoring 0 (DAPO, section 3.4;
verl's DAPO reward manager, TRL's `get_soft_overlong_punishment`, OpenRLHF's `--reward.overlong_buffer_len`).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """The penalty (<= 0) of a response of `length` tokens; 0 when `buffer_len` is 0 (off)."""
    if buffer_len <= 0 or factor == 0:
        return 0.0
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer {buffer_len} must be in (0, max_len = {max_len}]")
    over = length - (max_len - buffer_len)
    return -factor * min(over, buffer_len) / buffer_len if over > 0 else 0.0
