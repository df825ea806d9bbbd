"""A verifier for pipeline tests on tiny random models, which never write a correct \\boxed{} answer: rewarding
the share of digits in a response gives groups with different rewards, hence non-zero advantages."""


def digit_share(response: str, label: str, *, prompt: str = "", metadata: dict | None = None) -> float:
    if not response:
        return 0.0
    return sum(ch.isdigit() for ch in response) / len(response)
