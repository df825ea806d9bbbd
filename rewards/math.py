"""The built-in math verifier: high recall, bounded time.

1. Extract the answer: the last `\\boxed{...}` / `\\fbox{...}` (nested braces matched), else the last `Answer: ...`
   line (DAPO's prompt format).
2. Correct if any test passes, cheapest first: normalised string equality (Hendrycks-style), plain numeric
   equality, math-verify's symbolic equivalence (gold wrapped in `$...$`), numeric equality of the parsed
   expressions. Numbers are equal within 1e-6 relative.
3. The symbolic tests run under one deadline (default 5 s; rewards.deadline), on a main thread or in any thread;
   the plain ones are linear-time string work. A timeout scores 0 with `timed_out: True` (`2003^{2002^{2001}}`).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from rewards.deadline import CheckTimeout, call_with_deadline

REL_TOL = 1e-6
DEFAULT_TIMEOUT_S = 5.0


def math_verifier(
    response: str,
    label: str | list[str],
    *,
    prompt: str = "",
    metadata: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Score one response: `reward` (1.0 or 0.0), `acc`, `format_ok` (an answer was found), `pred` (the extracted
    answer), `timed_out`, and `method` (the test that passed) when correct. A list of labels is OR-ed."""
    pred = extract_answer(response)
    out: dict[str, Any] = {"reward": 0.0, "acc": False, "format_ok": bool(pred), "pred": pred or "", "timed_out": False}
    labels = label if isinstance(label, (list, tuple)) else [label]
    golds = [g for g in (gold_answer(str(x)) for x in labels) if g]
    if not pred or not golds:
        return out
    # the plain tests cannot hang; only the symbolic ones need a deadline (off the main thread: a forked child)
    method, symbolic_golds = grade_plain(pred, golds)
    if method is None and symbolic_golds:
        _warm_up()
        try:
            method = call_with_deadline(grade_symbolic, timeout_s, pred, symbolic_golds)
        except CheckTimeout:
            out["timed_out"] = True
            return out
    if method:
        out.update(reward=1.0, acc=True, method=method)
    return out


# ---------------------------------------------------------------------------------------------------- extraction

_BOX_START = re.compile(r"\\(?:boxed|fbox)(?=[\s{])")
_ANSWER_LINE = re.compile(r"(?i)\banswer\s*:\s*([^\n]+)")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (also `\\boxed 5`); None when there is none or the last
    one is never closed (a truncated response)."""
    starts = list(_BOX_START.finditer(text))
    if not starts:
        return None
    i = starts[-1].end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # `\boxed 5`: up to the next space or `$`
        return re.match(r"[^\s$]*", text[i:]).group(0)
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(response: str) -> str | None:
    """The answer a response commits to, stripped; None (or "") when it gives none."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(response)
    if not lines:
        return None
    answer = lines[-1].strip().strip("*").strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    return answer


def gold_answer(label: str) -> str:
    """A label as a bare answer: boxed labels are unboxed, `$...$` is dropped."""
    boxed = extract_boxed(label) if "\\boxed" in label or "\\fbox" in label else None
    text = (boxed if boxed is not None else label).strip()
    if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text.strip("$").strip()
    return text


# ---------------------------------------------------------------------------------------------------- comparison


def grade(pred: str, golds: list[str]) -> str | None:
    """Name of the first test that finds `pred` equal to one of `golds`, else None. No deadline of its own."""
    method, symbolic_golds = grade_plain(pred, golds)
    return method or grade_symbolic(pred, symbolic_golds)


def grade_plain(pred: str, golds: list[str]) -> tuple[str | None, list[str]]:
    """The string and plain-number tests (no sympy, linear time). Returns the passing test's name, else None and
    the golds left for the symbolic tests (none when both sides are plain numbers: nothing symbolic to add)."""
    left = []
    for gold in golds:
        if normalize(pred) == normalize(gold):
            return "string", []
        a, b = parse_number(pred), parse_number(gold)
        if a is None or b is None:
            left.append(gold)
        elif numbers_close(a, b):
            return "numeric", []
    return None, left


def grade_symbolic(pred: str, golds: list[str]) -> str | None:
    """math-verify's equivalence, then numeric equality of its parses. Can take forever: run under a deadline."""
    pred_parsed = _parse(pred) if golds else None
    for gold in golds:
        gold_parsed = _parse_gold(gold)
        if not pred_parsed or not gold_parsed:
            continue
        if _verify(gold_parsed, pred_parsed):
            return "math_verify"
        x, y = _as_fraction(gold_parsed[0]), _as_fraction(pred_parsed[0])  # e.g. `\\sqrt{2}` vs `1.4142136`
        if x is not None and y is not None and numbers_close(x, y):
            return "numeric"
    return None


def numbers_close(a: Fraction, b: Fraction) -> bool:
    """Equal within REL_TOL relative; two integers must be equal exactly (1000001 is not 1000000)."""
    if a.denominator == 1 and b.denominator == 1:
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


_gold_cache: dict[str, list] = {}
_warm = False


def _warm_up() -> None:
    """First math-verify call costs ~60 ms (lazy imports, sympy caches). Pay it once here, on a trivial input that
    cannot hang, so that checks run in forked children (off the main thread) start warm."""
    global _warm
    if _warm:
        return
    import math_verify.grader
    import math_verify.parser

    # we pass parsing_timeout=None / timeout_seconds=None on purpose (our own deadline): mute the one-time warning
    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    _verify(_parse("\\frac{1}{2}"), _parse("0.5"))
    _warm = True


def _parse(expr: str) -> list:
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; the caller's deadline rules
    from math_verify import parse

    return parse(f"${expr}$", parsing_timeout=None)


def _parse_gold(gold: str) -> list:
    # a prompt's label comes back with each of its n responses: parse it once
    if gold not in _gold_cache:
        if len(_gold_cache) > 4096:
            _gold_cache.clear()
        _gold_cache[gold] = _parse(gold)
    return _gold_cache[gold]


def _verify(gold_parsed: list, pred_parsed: list) -> bool:
    from math_verify import verify

    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _as_fraction(expr: Any) -> Fraction | None:
    """A real sympy number as a Fraction (exact for integers and rationals), else None."""
    try:
        if not getattr(expr, "is_number", False):
            return None
        if getattr(expr, "is_Rational", False):
            return Fraction(int(expr.p), int(expr.q))
        value = complex(expr.evalf(30))
    except Exception:  # noqa: BLE001 - anything sympy cannot turn into a number is not one
        return None
    if value.imag != 0 or not math.isfinite(value.real):
        return None
    return Fraction(value.real)


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE]([-+]?\d+))?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRACTION = re.compile(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}")


def parse_number(text: str) -> Fraction | None:
    """A plain number (integer, decimal, `1,000`, `a/b`, `\\frac{a}{b}`, scientific) as an exact Fraction, else None."""
    s = normalize(text).replace("{,}", ",")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        m = _NUMBER.fullmatch(s)
        if m and abs(int(m.group(1) or 0)) <= 400:  # Fraction("1e999999999") would build a billion-digit integer
            return Fraction(s)
        m = _FRACTION.fullmatch(s)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) == "-" else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


# ---------------------------------------------------------------------------------------------------- normalisation

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SHORT_LHS = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?!=)")


def normalize(answer: str) -> str:
    """Hendrycks-style canonical string of an answer, for exact comparison. Cosmetic only: two strings that
    normalise alike mean the same, the converse is left to the symbolic tests."""
    s = answer.strip().replace("\n", "")
    s = s.rstrip(".").strip()
    s = re.sub(r"\\[!,;:]|\\quad|\\qquad|~", " ", s)  # LaTeX spacing
    s = s.replace("\\\\", "\\")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left\b|\\right\b|\\big\b|\\Big\b", "", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", "", s)
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # a trailing unit written as `5 \text{ cm}`
        s = s.split("\\text{ ")[0]
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _SHORT_LHS.sub("", s)  # `x = 5` -> `5`
    s = s.replace(" ", "")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)  # `.5` -> `0.5`
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    s = re.sub(r"^([-+]?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)  # `3.0` -> `3`
    if s == "0.5":
        s = "\\frac{1}{2}"
    return s


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{7}` -> `\\frac{1}{7}`."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part or part[0] == "{":
            out += part
            continue
        if len(part) < 2:
            return s  # malformed: leave it to the symbolic tests
        a, rest = part[0], part[1:]
        if rest[0] == "{":
            out += "{" + a + "}" + rest
        else:
            out += "{" + a + "}{" + rest[0] + "}" + rest[1:]
    return out


__all__ = ["CheckTimeout", "extract_answer", "extract_boxed", "gold_answer", "grade", "math_verifier", "normalize"]
