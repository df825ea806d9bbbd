"""`rewards.load_verifier`: every spec form, every load error, and how results are normalised (no Ray here)."""

import math
import textwrap
import threading

import pytest

from rewards import VerifierLoadError, load_verifier
from rewards.loader import Verifier

PER_SAMPLE = textwrap.dedent(
    """
    def exact(response, label, *, prompt="", metadata=None):
        return float(response.strip() == label)

    def loose(response, label, **kwargs):
        return {"reward": 0.5, "acc": True, "note": kwargs["prompt"]}

    def one_arg(response):
        return 1.0

    NOT_A_FUNCTION = 3
    """
)
OPENRLHF = textwrap.dedent(
    """
    def reward_func(queries, prompts, labels, **kwargs):
        rewards = [1.0 if q.endswith(l) else 0.0 for q, l in zip(queries, labels)]
        return {"rewards": rewards, "scores": rewards, "extra_logs": {"n_chars": [len(q) for q in queries]}}
    """
)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def item(response, label="5", prompt="", metadata=None):
    return (response, label, prompt, metadata or {})


# ---------------------------------------------------------------------------------------------------- forms


def test_builtin_math():
    v = load_verifier("math")
    assert isinstance(v, Verifier) and v.spec == "math" and v.batched is False
    [r] = v.score([item("\\boxed{5}")], timeout_s=5)
    assert r["reward"] == 1.0 and r["acc"] is True and r["info"]["pred"] == "5"


def test_builtin_countdown():
    v = load_verifier("countdown")
    [r] = v.score([item("<answer>2 + 3</answer>", '{"target": 5, "numbers": [2, 3]}')], timeout_s=5)
    assert r["reward"] == 1.0


def test_dotted_module_path():
    v = load_verifier("rewards.math:math_verifier")
    assert v.spec == "rewards.math:math_verifier" and v.batched is False
    assert v.score([item("Answer: 5")], timeout_s=5)[0]["acc"] is True


def test_file_path_with_function_is_made_absolute(tmp_path, monkeypatch):
    path = write(tmp_path, "mine.py", PER_SAMPLE)
    monkeypatch.chdir(tmp_path)
    v = load_verifier("mine.py:exact")
    assert v.spec == f"{path}:exact" and v.batched is False
    assert [r["reward"] for r in v.score([item("5"), item("6")], timeout_s=5)] == [1.0, 0.0]
    assert load_verifier(v.spec).fn(" 5", "5") == 1.0  # the normalised spec loads from anywhere


def test_function_taking_kwargs(tmp_path):
    v = load_verifier(f"{write(tmp_path, 'mine.py', PER_SAMPLE)}:loose")
    [r] = v.score([item("x", prompt="the prompt")], timeout_s=5)
    assert r["reward"] == 0.5 and r["acc"] is True and r["info"] == {"note": "the prompt"}


def test_openrlhf_file(tmp_path):
    path = write(tmp_path, "rm.py", OPENRLHF)
    v = load_verifier(str(path))
    assert v.batched is True and v.spec == str(path)
    results = v.score([item("42", "42", prompt="Q:"), item("41", "42", prompt="Q:")], timeout_s=5)
    assert [r["reward"] for r in results] == [1.0, 0.0]
    assert [r["acc"] for r in results] == [True, False]
    assert [r["logs"] for r in results] == [{"n_chars": 4.0}, {"n_chars": 4.0}]


def test_openrlhf_function_named_explicitly(tmp_path):
    v = load_verifier(f"{write(tmp_path, 'rm.py', OPENRLHF)}:reward_func")
    assert v.batched is True


def test_openrlhf_tensors_and_bare_rewards(tmp_path):
    import torch

    v = load_verifier(str(write(tmp_path, "rm.py", OPENRLHF)))
    v.fn = lambda queries, prompts, labels: {
        "rewards": torch.tensor([0.0, 1.0]),
        "extra_logs": {"k": torch.tensor(3.0)},
    }
    results = v.score([item("a"), item("b")], timeout_s=5)
    assert [r["reward"] for r in results] == [0.0, 1.0] and [r["logs"]["k"] for r in results] == [3.0, 3.0]
    v.fn = lambda queries, prompts, labels: torch.tensor([1.0, 0.0])  # older OpenRLHF files return only the rewards
    assert [r["reward"] for r in v.score([item("a"), item("b")], timeout_s=5)] == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------- load errors


def test_load_error_is_a_value_error():
    assert issubclass(VerifierLoadError, ValueError)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(VerifierLoadError, match=f"verifier '{missing}:f': file not found: {missing}"):
        load_verifier(f"{missing}:f")
    with pytest.raises(VerifierLoadError, match=f"file not found: {missing}"):
        load_verifier(str(missing))


def test_missing_function_in_file(tmp_path):
    path = write(tmp_path, "mine.py", PER_SAMPLE)
    with pytest.raises(VerifierLoadError, match=f"{path} has no function 'nope'"):
        load_verifier(f"{path}:nope")


def test_missing_function_in_module():
    with pytest.raises(VerifierLoadError, match="verifier 'rewards.math:nope': module 'rewards.math' has no function"):
        load_verifier("rewards.math:nope")


def test_openrlhf_file_without_reward_func(tmp_path):
    path = write(tmp_path, "mine.py", PER_SAMPLE)
    with pytest.raises(VerifierLoadError, match=f"{path} defines no reward_func.*name it as {path}:function"):
        load_verifier(str(path))


def test_wrong_signature(tmp_path):
    path = write(tmp_path, "mine.py", PER_SAMPLE)
    with pytest.raises(VerifierLoadError, match=r"one_arg\(response\) must accept \(response, label, \*, prompt"):
        load_verifier(f"{path}:one_arg")
    bad_rm = write(tmp_path, "bad_rm.py", "def reward_func(queries):\n    return []\n")
    with pytest.raises(VerifierLoadError, match=r"reward_func\(queries\) must accept \(queries, prompts, labels\)"):
        load_verifier(str(bad_rm))


def test_not_callable(tmp_path):
    path = write(tmp_path, "mine.py", PER_SAMPLE)
    with pytest.raises(VerifierLoadError, match="'NOT_A_FUNCTION' is a int, not a function"):
        load_verifier(f"{path}:NOT_A_FUNCTION")


def test_import_error_in_users_file(tmp_path):
    path = write(tmp_path, "broken.py", "import package_that_does_not_exist_42\n\ndef f(r, l, **kw):\n    return 0\n")
    with pytest.raises(VerifierLoadError, match=f"importing {path} failed: ModuleNotFoundError: .*_42"):
        load_verifier(f"{path}:f")
    syntax = write(tmp_path, "syntax.py", "def f(:\n")
    with pytest.raises(VerifierLoadError, match=f"importing {syntax} failed: SyntaxError"):
        load_verifier(f"{syntax}:f")


def test_import_error_in_module():
    with pytest.raises(VerifierLoadError, match="importing module 'no_such_pkg_42.mod' failed: ModuleNotFoundError"):
        load_verifier("no_such_pkg_42.mod:f")


def test_unknown_and_empty_specs():
    with pytest.raises(
        VerifierLoadError, match="unknown verifier 'mathh': expected a built-in name \\(math, countdown"
    ):
        load_verifier("mathh")
    with pytest.raises(VerifierLoadError, match="empty verifier spec"):
        load_verifier("  ")
    with pytest.raises(VerifierLoadError, match="'not-a-name' is not a function name"):
        load_verifier("rewards.math:not-a-name")


# ---------------------------------------------------------------------------------------------------- results


def scored(fn, *items, timeout_s=5.0):
    return Verifier(spec="test", fn=fn, batched=False).score(list(items) or [item("x")], timeout_s)


def test_float_and_dict_results():
    [r] = scored(lambda response, label, **kw: 1)
    assert (r["reward"], r["acc"], r["format_ok"], r["error"]) == (1.0, True, True, None)
    [r] = scored(lambda response, label, **kw: 0.25)
    assert (r["reward"], r["acc"]) == (0.25, False)
    [r] = scored(lambda response, label, **kw: {"reward": 1.0, "format_ok": False, "why": object()})
    assert r["acc"] is True and r["format_ok"] is False and r["info"]["why"].startswith("<object object")


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda response, label, **kw: 1 / 0, "ZeroDivisionError: division by zero"),
        (lambda response, label, **kw: {"score": 1.0}, "ValueError: the verifier returned a dict without 'reward'"),
        (lambda response, label, **kw: math.nan, "ValueError: reward is nan"),
        (lambda response, label, **kw: "1.0", "TypeError: the verifier returned str"),
    ],
)
def test_bad_results_become_errors(fn, message):
    [r] = scored(fn)
    assert r["reward"] == 0.0 and r["acc"] is False and r["timed_out"] is False
    assert r["error"].startswith(message)


def test_sys_exit_is_an_error_not_an_exit():
    import sys

    [r] = scored(lambda response, label, **kw: sys.exit(3))
    assert r["error"] == "SystemExit: 3"


# Off the main thread each check runs in a forked child, so the deadline has to cover forking this process too.
# 3 s is ample for that at a load of 4 on 2 cores; the slow check sleeps far beyond it.
CHECK_DEADLINE_S = 3.0
SLOW_CHECK_S = 120.0


def test_timeouts_on_main_thread_and_in_a_thread():
    import time

    def slow(response, label, **kw):
        if response == "slow":
            time.sleep(SLOW_CHECK_S)
        return 1.0

    items = [item("slow"), item("fast")]
    start = time.monotonic()
    results = scored(slow, *items, timeout_s=CHECK_DEADLINE_S)
    main_thread_s = time.monotonic() - start
    assert [(r["timed_out"], r["reward"]) for r in results] == [(True, 0.0), (False, 1.0)]
    # cut at its deadline: not before it, and long before the slow check would have returned
    assert CHECK_DEADLINE_S - 0.1 <= main_thread_s < SLOW_CHECK_S / 2, main_thread_s

    box = {}

    def in_thread():
        start = time.monotonic()
        box["results"] = scored(slow, *items, timeout_s=CHECK_DEADLINE_S)
        box["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(SLOW_CHECK_S)
    assert not thread.is_alive()
    assert [(r["timed_out"], r["reward"]) for r in box["results"]] == [(True, 0.0), (False, 1.0)]
    assert CHECK_DEADLINE_S - 0.1 <= box["seconds"] < SLOW_CHECK_S / 2, box["seconds"]


def test_openrlhf_failures_cover_the_batch(tmp_path):
    v = load_verifier(str(write(tmp_path, "rm.py", OPENRLHF)))
    v.fn = lambda queries, prompts, labels: {"rewards": [1.0]}  # one reward for two samples
    results = v.score([item("a"), item("b")], timeout_s=5)
    assert [r["error"] for r in results] == ["ValueError: reward_func returned 1 rewards for a batch of 2"] * 2
    v.fn = lambda queries, prompts, labels: {"scores": [1.0, 1.0]}
    assert "without 'rewards'" in v.score([item("a"), item("b")], timeout_s=5)[0]["error"]
