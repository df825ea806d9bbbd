"""The built-in math verifier over the case corpus, its extraction, and its deadline on and off the main thread."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rewards.deadline import CheckTimeout, call_with_deadline
from rewards.math import extract_answer, gold_answer, math_verifier, normalize

CASES_FILE = Path(__file__).parents[1] / "data" / "math_verifier_cases.jsonl"
CASES = [json.loads(line) for line in CASES_FILE.read_text().splitlines() if line.strip()]
HANG = "The answer is \\boxed{2003^{2002^{2001}}}"  # never finishes: only a deadline ends it
# A check cut by its deadline must come back well before this. The deadlines are 0.3-1 s; the bound leaves room for
# a loaded machine (a load of 4 on 2 cores) and for forking this process off the main thread.
RETURNED_WITHIN_S = 30.0
# checks that must succeed get a deadline no loaded machine reaches (forking included)
GENEROUS_S = 60.0


def test_corpus_is_large_and_two_sided():
    assert len(CASES) >= 150
    assert sum(c["expected"] for c in CASES) >= 60 and sum(not c["expected"] for c in CASES) >= 60


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['note']}" for i, c in enumerate(CASES)])
def test_corpus_case(case):
    out = math_verifier(case["response"], case["label"])
    assert out["acc"] is case["expected"], out
    assert out["reward"] == (1.0 if case["expected"] else 0.0)
    assert out["timed_out"] is False
    if "format_ok" in case:
        assert out["format_ok"] is case["format_ok"]


@pytest.mark.parametrize(
    "response, pred",
    [
        ("so \\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed{1} then \\fbox{2} then \\boxed{3}", "3"),
        ("\\boxed{\\left\\{1,2\\right\\}}", "\\left\\{1,2\\right\\}"),
        ("Answer: 4\nAnswer: $5$.", "5"),
        ("**Final Answer:** 17", "17"),
        ("\\boxed{7} and later \\boxed{8", None),  # the last box is cut off: no answer, not the earlier box
        ("no marker at all", None),
    ],
)
def test_extraction(response, pred):
    assert extract_answer(response) == pred


def test_gold_forms_and_label_lists():
    assert gold_answer("\\boxed{12}") == gold_answer("$12$") == gold_answer(" 12 ") == "12"
    assert math_verifier("\\boxed{3}", ["2", "3"])["acc"] is True
    assert math_verifier("\\boxed{4}", ["2", "3"])["acc"] is False


def test_normalize_is_cosmetic():
    assert normalize("\\left( \\dfrac{1}{2}, 3 \\right)") == normalize("(\\frac12,3)")
    assert normalize("90^\\circ") == normalize("90") and normalize("\\$5") == "5" and normalize("50\\%") == "50"
    assert normalize("(1,2)") != normalize("(2,1)")


def test_result_fields():
    out = math_verifier("\\boxed{0.5}", "\\frac{1}{2}", prompt="p", metadata={"x": 1})
    assert out["reward"] == 1.0 and out["acc"] is True and out["format_ok"] is True and out["pred"] == "0.5"
    assert out["method"] in ("string", "numeric", "math_verify")
    out = math_verifier("nothing", "1")
    assert out == {"reward": 0.0, "acc": False, "format_ok": False, "pred": "", "timed_out": False}


def test_timeout_on_the_main_thread():
    assert threading.current_thread() is threading.main_thread()
    handler_before = signal.getsignal(signal.SIGALRM)
    start = time.monotonic()
    out = math_verifier(HANG, "5", timeout_s=1.0)
    assert 0.9 <= time.monotonic() - start < RETURNED_WITHIN_S
    assert out["timed_out"] is True and out["reward"] == 0.0 and out["format_ok"] is True
    # the caller's SIGALRM handler is back (pytest-timeout's, here) and the next check is unaffected
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert math_verifier("\\boxed{5}", "5")["acc"] is True


def test_timeout_inside_a_thread():
    results = {}

    def work():
        start = time.monotonic()
        results["hang"] = math_verifier(HANG, "5", timeout_s=1.0)
        results["hang_s"] = time.monotonic() - start
        # symbolic checks work off the main thread (math-verify's own signal.alarm would raise here)
        results["ok"] = math_verifier("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", timeout_s=GENEROUS_S)
        results["wrong"] = math_verifier("\\boxed{(2,1)}", "(1,2)", timeout_s=GENEROUS_S)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(3 * GENEROUS_S)
    assert not thread.is_alive()
    assert results["hang"]["timed_out"] is True and results["hang"]["reward"] == 0.0
    assert 0.9 <= results["hang_s"] < RETURNED_WITHIN_S
    assert results["ok"]["acc"] is True and results["wrong"]["acc"] is False


def test_nested_deadlines_keep_the_outer_timer():
    signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert call_with_deadline(lambda x: x + 1, 1.0, 41) == 42
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90 < left <= 100
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_outer_deadline_shorter_than_the_verifier_own():
    # The outer 0.5 s deadline reaches the verifier's own (60 s) call as its timeout: the verifier reports it, and it
    # does not fire a second time in the caller once the verifier has returned. Returning well before 60 s shows it
    # was the outer deadline that ended the check.
    for _ in range(5):  # the second firing, when it happened, came a microsecond later: repeat to catch a race
        start = time.monotonic()
        out = call_with_deadline(math_verifier, 0.5, HANG, "5", timeout_s=GENEROUS_S)
        assert out["timed_out"] is True and out["reward"] == 0.0
        assert 0.4 <= time.monotonic() - start < RETURNED_WITHIN_S


def test_an_outer_timer_that_is_not_ours_fires_through_the_verifier():
    # pytest-timeout's kind of timer: when it expires first, its own handler runs (the verifier does not turn it into
    # one of its timeouts and carry on)
    class OuterTimeout(BaseException):
        pass

    def outer(signum, frame):
        raise OuterTimeout()

    signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(OuterTimeout):
            math_verifier(HANG, "5", timeout_s=5.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


def test_deadline_cannot_be_swallowed_by_except_exception():
    def stubborn():
        while True:
            try:
                time.sleep(10)
            except Exception:  # noqa: BLE001 - what careless verifier code does
                pass

    start = time.monotonic()
    with pytest.raises(CheckTimeout):
        call_with_deadline(stubborn, 0.3)
    assert time.monotonic() - start < RETURNED_WITHIN_S  # stubborn never returns by itself


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(3 * GENEROUS_S)
    return box


def test_child_process_deadline_in_a_thread():
    assert _in_thread(lambda: call_with_deadline(lambda: 6 * 7, GENEROUS_S)) == {"value": 42}
    box = _in_thread(lambda: call_with_deadline(time.sleep, 0.3, 2 * GENEROUS_S))
    assert isinstance(box["error"], CheckTimeout)
    box = _in_thread(lambda: call_with_deadline(int, GENEROUS_S, "not a number"))
    assert isinstance(box["error"], ValueError)
    box = _in_thread(lambda: call_with_deadline(os._exit, GENEROUS_S, 7))
    assert isinstance(box["error"], RuntimeError) and "exit code 7" in str(box["error"])
