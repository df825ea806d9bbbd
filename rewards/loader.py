"""Verifier plug-ins: load one from a spec string and score samples with it, isolating its failures.

Spec forms (the `--reward.verifier` flag):
  math                       a built-in name (BUILTINS)
  pkg.module:function        a function in an importable module
  path/to/file.py:function   a function in a Python file
  path/to/file.py            an OpenRLHF reward file: it defines `reward_func(queries, prompts, labels, **kw)`

A per-sample verifier is any callable `(response, label, *, prompt, metadata) -> float | dict`; a dict carries at
least `reward` (or verl's `score`), optionally `acc`, `format_ok` and any extra fields; one that also takes a
`timeout_s` keyword gets --reward.timeout_s. A verl reward function, `compute_score(data_source, solution_str,
ground_truth, extra_info)`, is told by its parameter names and called with them by keyword, as verl's reward managers
call it. An OpenRLHF `reward_func` is called once per batch and returns `{"rewards", "scores", "extra_logs"}`
(tensors or lists) or just the rewards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.deadline import CheckTimeout, call_with_deadline

BUILTINS = {
    "math": "rewards.math:math_verifier",
    "countdown": "rewards.examples.countdown:countdown_verifier",
    "agent": "rewards.agent:agent_reward",  # an OpenRLHF agent file's own reward (--rollout.function openrlhf_agent)
}
OPENRLHF_FUNCTION = "reward_func"
VERL_PARAMETERS = frozenset({"data_source", "solution_str", "ground_truth", "extra_info"})  # verl's compute_score
_FORMS = f"a built-in name ({', '.join(BUILTINS)}), pkg.module:function, path/file.py:function"
_FORMS += " or an OpenRLHF reward .py file"

# One item to score: (response, label, prompt, metadata), optionally followed by the whole sequence as OpenRLHF
# decodes it for its reward_func (prompt and response tokens together, special tokens kept); without it an OpenRLHF
# file gets prompt + response
Item = tuple[str, Any, str, dict] | tuple[str, Any, str, dict, str]


class VerifierLoadError(ValueError):
    """The verifier spec names something that cannot be loaded or called as a verifier."""


@dataclass
class Verifier:
    """A loaded verifier. `spec` is the normalised spec (files made absolute), loadable from any process."""

    spec: str
    fn: Callable[..., Any]
    batched: bool  # True for an OpenRLHF reward_func, called once per batch
    verl: bool = False  # a verl compute_score(data_source, solution_str, ground_truth, extra_info), called by keyword
    takes_timeout: bool = False  # it accepts timeout_s= (the built-in math verifier's symbolic deadline)

    def score(self, items: list[Item], timeout_s: float | None) -> list[dict[str, Any]]:
        """One result per item, in order: `reward`, `acc`, `format_ok`, `timed_out`, `error` (None or a message),
        `info` (the verifier's extra fields) and `logs` (OpenRLHF extra_logs). Never raises for the verifier's
        sake: an exception scores 0 with `error`, a check past `timeout_s` scores 0 with `timed_out`."""
        if self.batched:
            return self._score_batch(items, timeout_s)
        results = []
        for response, label, prompt, metadata, *_ in items:
            if self.verl:  # verl's extra_info is the row's; here it also holds the row's other fields
                args, kwargs = (), {"data_source": metadata.get("data_source", ""), "solution_str": response,
                                    "ground_truth": label, "extra_info": metadata}  # fmt: skip
            else:
                args, kwargs = (response, label), {"prompt": prompt, "metadata": metadata}
            if self.takes_timeout:
                kwargs["timeout_s"] = timeout_s
            try:
                out = call_with_deadline(self.fn, timeout_s, *args, **kwargs)
                results.append(_per_sample_result(out))
            except CheckTimeout:
                results.append(failed_result(timed_out=True))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's verifier may raise anything
                results.append(failed_result(error=f"{type(e).__name__}: {e}"))
        return results

    def _score_batch(self, items: list[Item], timeout_s: float | None) -> list[dict[str, Any]]:
        n = len(items)
        # OpenRLHF passes the whole decoded sequence as the query
        queries = [item[4] if len(item) > 4 else item[2] + item[0] for item in items]
        prompts = [item[2] for item in items]
        labels = [item[1] for item in items]
        try:
            out = call_with_deadline(self.fn, timeout_s * n if timeout_s else None, queries, prompts, labels)
            return _batch_results(out, n)
        except CheckTimeout:
            return [failed_result(timed_out=True) for _ in range(n)]
        except (Exception, SystemExit) as e:  # noqa: BLE001
            return [failed_result(error=f"{type(e).__name__}: {e}") for _ in range(n)]


# The errors this module raises itself when a verifier's result has the wrong shape (_per_sample_result,
# _reward_value, _batch_results, _as_list): whatever the response, every sample would fail the same way.
SHAPE_ERRORS = (
    "ValueError: the verifier returned", "TypeError: the verifier returned", "ValueError: reward is",
    "ValueError: reward_func returned",
)  # fmt: skip


def probe(verifier: Verifier, item: Item, timeout_s: float | None) -> tuple[str | None, bool]:
    """What goes wrong when `verifier` scores `item` (one real row, its label given as the response): (None, False)
    when nothing does; else the error and whether it is a result of the wrong shape (SHAPE_ERRORS), which every
    sample of a run would give. Another exception or a timeout may be this response's own (a label is rarely in the
    answer format the verifier parses). Only a failure counts: the reward itself says nothing here. An OpenRLHF file
    gets the item twice in one call, so that its batch length is checked too."""
    for result in verifier.score([item] * (2 if verifier.batched else 1), timeout_s):
        if result["error"]:
            return result["error"], result["error"].startswith(SHAPE_ERRORS)
        if result["timed_out"]:
            return f"no result within --reward.timeout_s {timeout_s:g}", False
    return None, False


def failed_result(*, error: str | None = None, timed_out: bool = False) -> dict[str, Any]:
    return {
        "reward": 0.0,
        "acc": False,
        "format_ok": False,
        "timed_out": timed_out,
        "error": error,
        "info": {},
        "logs": {},
    }


def _reward_value(value: Any) -> float:
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward is {reward}")  # a NaN reward would poison every advantage of its group
    return reward


def _plain(value: Any) -> Any:
    """Extra fields travel through Ray and into W&B: keep plain data, stringify the rest."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 64:
        return [_plain(v) for v in value]
    if isinstance(value, dict) and len(value) <= 64:
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)[:500]


def _per_sample_result(out: Any) -> dict[str, Any]:
    if isinstance(out, dict):
        key = "reward" if "reward" in out else "score"  # verl's reward functions name it score
        if key not in out:
            raise ValueError(f"the verifier returned a dict without 'reward' or 'score' (keys: {sorted(out)})")
        reward = _reward_value(out[key])
        info = {k: _plain(v) for k, v in out.items() if k not in (key, "acc", "format_ok", "timed_out", "error")}
        return {
            "reward": reward,
            "acc": bool(out.get("acc", reward >= 1.0)),
            "format_ok": bool(out.get("format_ok", True)),
            "timed_out": bool(out.get("timed_out", False)),
            "error": None,
            "info": info,
            "logs": {},
        }
    if isinstance(out, (int, float)) or hasattr(out, "item"):  # bool, int, float, 0-d tensor or numpy scalar
        reward = _reward_value(out.item() if hasattr(out, "item") else out)
        return {**failed_result(), "reward": reward, "acc": reward >= 1.0, "format_ok": True}
    raise TypeError(f"the verifier returned {type(out).__name__}; expected a float or a dict with 'reward'")


def _as_list(values: Any, n: int, what: str) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (int, float)):
        return [float(values)] * n  # a batch-level scalar applies to every sample
    values = list(values)
    if len(values) != n:
        raise ValueError(f"reward_func returned {len(values)} {what} for a batch of {n}")
    return [float(v) for v in values]


def _batch_results(out: Any, n: int) -> list[dict[str, Any]]:
    if not isinstance(out, dict):
        out = {"rewards": out}  # older OpenRLHF reward files return just the rewards tensor
    if "rewards" not in out:
        raise ValueError(f"reward_func returned a dict without 'rewards' (keys: {sorted(out)})")
    rewards = [_reward_value(r) for r in _as_list(out["rewards"], n, "rewards")]
    scores = _as_list(out["scores"], n, "scores") if out.get("scores") is not None else rewards
    logs = {str(k): _as_list(v, n, f"extra_logs[{k!r}]") for k, v in (out.get("extra_logs") or {}).items()}
    return [
        {
            "reward": rewards[i],
            "acc": scores[i] >= 1.0,
            "format_ok": True,
            "timed_out": False,
            "error": None,
            "info": {"score": scores[i], **{k: v[i] for k, v in logs.items()}},
            "logs": {k: v[i] for k, v in logs.items()},
        }
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------------------------- loading


def load_verifier(spec: str) -> Verifier:
    """Load a verifier from a spec (see the module doc). Raises VerifierLoadError naming the spec, the file and
    the function when anything is wrong: missing file or function, an import error, a wrong signature."""
    spec = spec.strip()
    if not spec:
        raise VerifierLoadError(f"empty verifier spec: expected {_FORMS}")
    if spec in BUILTINS:
        return dataclasses.replace(load_verifier(BUILTINS[spec]), spec=spec)
    if spec.endswith(".py"):
        path = _resolve_file(spec, spec)
        module = _import_file(path, spec)
        if not hasattr(module, OPENRLHF_FUNCTION):
            raise VerifierLoadError(
                f"verifier {spec!r}: {path} defines no {OPENRLHF_FUNCTION}(queries, prompts, labels); "
                f"to use another function name it as {spec}:function"
            )
        return _checked(str(path), getattr(module, OPENRLHF_FUNCTION), OPENRLHF_FUNCTION, spec, batched=True)
    if ":" not in spec:
        raise VerifierLoadError(f"unknown verifier {spec!r}: expected {_FORMS}")
    target, name = spec.rsplit(":", 1)
    if not name.isidentifier():
        raise VerifierLoadError(f"verifier {spec!r}: {name!r} is not a function name")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = _resolve_file(target, spec)
        module = _import_file(path, spec)
        where, normalised = str(path), f"{path}:{name}"
    else:
        try:
            module = importlib.import_module(target)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure inside the user's module
            message = f"verifier {spec!r}: importing module {target!r} failed: {type(e).__name__}: {e}"
            raise VerifierLoadError(message) from e
        where, normalised = f"module {target!r}", spec
    if not hasattr(module, name):
        raise VerifierLoadError(f"verifier {spec!r}: {where} has no function {name!r}")
    batched = name == OPENRLHF_FUNCTION and _accepts(getattr(module, name), [], [], [])
    return _checked(normalised, getattr(module, name), name, spec, batched=batched)


def _resolve_file(path_text: str, spec: str) -> Path:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise VerifierLoadError(f"verifier {spec!r}: file not found: {path}")
    return path


def _import_file(path: Path, spec: str):
    # a stable, unique module name per file, registered so that pickling and dataclasses inside it work
    module_name = f"_verifier_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - SyntaxError, ImportError, or anything the file runs
        del sys.modules[module_name]
        raise VerifierLoadError(f"verifier {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def _accepts(fn: Callable, *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:
        return True  # builtins without a signature: trust the user
    return True


def _checked(normalised: str, fn: Any, name: str, spec: str, *, batched: bool) -> Verifier:
    if not callable(fn):
        raise VerifierLoadError(f"verifier {spec!r}: {name!r} is a {type(fn).__name__}, not a function")
    if batched:
        if not _accepts(fn, [], [], []):
            raise VerifierLoadError(
                f"verifier {spec!r}: {name}{inspect.signature(fn)} must accept (queries, prompts, labels)"
            )
        return Verifier(spec=normalised, fn=fn, batched=True)
    takes_timeout = "timeout_s" in _parameter_names(fn)
    if _parameter_names(fn) >= VERL_PARAMETERS - {"extra_info"}:
        if not _accepts(fn, data_source="", solution_str="", ground_truth="", extra_info={}):
            raise VerifierLoadError(
                f"verifier {spec!r}: {name}{inspect.signature(fn)} looks like a verl reward function but does not "
                "accept (data_source, solution_str, ground_truth, extra_info) by keyword"
            )
        return Verifier(spec=normalised, fn=fn, batched=False, verl=True, takes_timeout=takes_timeout)
    if not _accepts(fn, "response", "label", prompt="", metadata={}):
        raise VerifierLoadError(
            f"verifier {spec!r}: {name}{inspect.signature(fn)} must accept (response, label, *, prompt, metadata), "
            "or be a verl compute_score(data_source, solution_str, ground_truth, extra_info)"
        )
    return Verifier(spec=normalised, fn=fn, batched=False, takes_timeout=takes_timeout)


def _parameter_names(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except ValueError:  # builtins without a signature
        return set()
