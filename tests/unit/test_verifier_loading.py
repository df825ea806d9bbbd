"""`rewards.load_verifier`: every spec form, every load error, and how results are normalised (no Ray here)."""

import math
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from rewards import VerifierLoadError, load_verifier, probe
from rewards.loader import Verifier
from rewards.math import math_verifier

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


def test_openrlhf_file_gets_the_decoded_sequence_when_the_item_holds_it(tmp_path):
    v = load_verifier(str(write(tmp_path, "rm.py", OPENRLHF)))
    seen = {}
    v.fn = lambda queries, prompts, labels: seen.update(queries=queries, prompts=prompts) or [1.0, 1.0]
    decoded = "<|im_start|>user\nQ:<|im_end|>\n<|im_start|>assistant\n42<|im_end|>"
    v.score([(*item("42", "42", prompt="Q:"), decoded), item("41", "42", prompt="Q:")], timeout_s=5)
    assert seen == {"queries": [decoded, "Q:41"], "prompts": ["Q:", "Q:"]}  # without it: prompt + response
    per_sample = load_verifier(f"{write(tmp_path, 'mine.py', PER_SAMPLE)}:exact")  # ignores it
    assert [r["reward"] for r in per_sample.score([(*item("5"), decoded)], timeout_s=5)] == [1.0]


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
        (
            lambda response, label, **kw: {"value": 1.0},
            "ValueError: the verifier returned a dict without 'reward' or 'score'",
        ),
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


# ---------------------------------------------------------------------------------------------------- verl's form

VERL = textwrap.dedent(
    """
    CALLS = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        CALLS.append((data_source, solution_str, ground_truth, extra_info))
        ok = solution_str.strip() == ground_truth
        return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": solution_str.strip()}

    def plain_score(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5

    def no_extra_info(data_source, solution_str, ground_truth):
        return 1.0
    """
)


def test_a_verl_compute_score_is_called_by_keyword_with_the_row_and_its_score_is_the_reward(tmp_path):
    path = write(tmp_path, "verl_reward.py", VERL)
    v = load_verifier(f"{path}:compute_score")
    assert v.verl is True and v.batched is False
    meta = {"data_source": "openai/gsm8k", "index": 7}
    right, wrong = v.score([item("42", "42", "Q?", meta), item("41", "42", "Q?", meta)], 5.0)
    assert (right["reward"], right["acc"], right["info"]["pred"], right["error"]) == (1.0, True, "42", None)
    assert (wrong["reward"], wrong["acc"]) == (-1.0, False)  # verl's -1 for a wrong answer stays -1
    calls = next(m for name, m in sys.modules.items() if name.startswith("_verifier_verl_reward")).CALLS
    assert calls[0] == ("openai/gsm8k", "42", "42", meta)  # extra_info: the row's other fields
    [r] = load_verifier(f"{path}:plain_score").score([item("x", "y")], 5.0)
    assert r["reward"] == 0.5 and r["acc"] is False
    with pytest.raises(VerifierLoadError, match="looks like a verl reward function but does not accept"):
        load_verifier(f"{path}:no_extra_info")


def test_a_verifier_taking_timeout_s_gets_the_runs_deadline(tmp_path):
    path = write(tmp_path, "timed.py", "def f(response, label, *, prompt='', metadata=None, timeout_s=5.0):\n"
                                        "    return {'reward': 1.0, 'deadline': timeout_s}\n")  # fmt: skip
    [r] = load_verifier(f"{path}:f").score([item("x")], 12.5)
    assert r["info"]["deadline"] == 12.5
    assert load_verifier("math").takes_timeout is True  # its symbolic tests take --reward.timeout_s
    assert load_verifier(f"{write(tmp_path, 'p.py', PER_SAMPLE)}:exact").takes_timeout is False


def test_system_exit_while_importing_a_module_names_the_verifier(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(VerifierLoadError, match="importing module 'exits_on_import' failed: SystemExit: no GPU here"):
        load_verifier("exits_on_import:f")


def test_probe_reports_a_verifier_that_fails_on_a_real_row_and_passes_a_sound_one(tmp_path):
    trl_source = "def accuracy_reward(prompts, completions, **kwargs):\n    return [0.0 for _ in kwargs['solution']]\n"
    trl = write(tmp_path, "trl_style.py", trl_source)
    short = write(tmp_path, "short.py", "def reward_func(queries, prompts, labels):\n    return [1.0]\n")
    row = ("4", "4", "What is 2 + 2?", {"data_source": "", "response_tokens": 1, "finish_reason": "stop"})
    # a TRL reward function binds to the per-sample call (prompts<-response, completions<-label) and then fails
    # the verifier's own exception may be this response's: said, not refused
    assert probe(load_verifier(f"{trl}:accuracy_reward"), row, 5.0) == ("KeyError: 'solution'", False)
    # a result of the wrong shape fails every sample: refused
    short_batch = "ValueError: reward_func returned 1 rewards for a batch of 2"
    assert probe(load_verifier(str(short)), row, 5.0) == (short_batch, True)
    no_reward = write(tmp_path, "no_reward.py", "def f(response, label, **kw):\n    return {'value': 1.0}\n")
    assert probe(load_verifier(f"{no_reward}:f"), row, 5.0) == (
        "ValueError: the verifier returned a dict without 'reward' or 'score' (keys: ['value'])", True
    )  # fmt: skip
    assert probe(load_verifier("math"), row, 5.0) == (None, False)
    assert probe(load_verifier(f"{write(tmp_path, 'p.py', PER_SAMPLE)}:exact"), row, 5.0) == (None, False)
    hang = write(tmp_path, "hang.py", "import time\n\ndef f(response, label, **kw):\n    time.sleep(30)\n")
    assert probe(load_verifier(f"{hang}:f"), row, 0.2) == ("no result within --reward.timeout_s 0.2", False)


def test_the_example_openrlhf_math_file_scores_as_the_math_verifier_does():
    path = Path(__file__).parents[2] / "rewards" / "examples" / "openrlhf_math.py"
    v = load_verifier(str(path))
    assert v.batched is True
    prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    responses = ["So \\boxed{4}.<|im_end|>", "It is \\boxed{5}.", "no answer at all", "Answer: 4<|im_end|>"]
    results = v.score([(r, "4", prompt, {}) for r in responses], 5.0)
    want = [1.0, 0.0, 0.0, 1.0]
    assert [r["reward"] for r in results] == [math_verifier(r, "4")["reward"] for r in responses] == want
    assert [r["logs"]["format_ok"] for r in results] == [1.0, 1.0, 0.0, 1.0] and results[0]["acc"] is True
