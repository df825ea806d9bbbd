"""Verifiers for tests on tiny random models, which never write a correct \\boxed{} answer. Rewarding
the share of digits in a response gives groups with different rewards, hence non-zero advantages."""


def digit_share(response: str, label: str, *, prompt: str = "", metadata: dict | None = None) -> float:
    if not response:
        return 0.0
    return sum(ch.isdigit() for ch in response) / len(response)


def marked_right(response: str, label: str, *, prompt: str = "", metadata: dict | None = None) -> float:
    """Correct exactly when the test row says so (its `right` field), whatever the response: evaluation tests
    choose each source's accuracy."""
    return 1.0 if (metadata or {}).get("right") else 0.0


def needs_solution(response: str, label: str, *, prompt: str = "", metadata: dict | None = None) -> float:
    """Raises on every response, as a TRL reward function does when bound without the `solution` column it reads."""
    return float((metadata or {})["solution"] == response)
