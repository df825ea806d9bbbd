"""Prompt datasets: jsonl, parquet, or a saved HF dataset folder, in OpenRLHF's or verl's schema.

    OpenRLHF:  {"prompt": "What is 2 + 3?", "label": "5"}                    (input_key / label_key name the fields)
               {"prompt": [{"role": "user", "content": "..."}], "label": "5"}
    verl/DAPO: {"prompt": [{"role": "user", "content": "..."}], "reward_model": {"ground_truth": "5"},
                "data_source": "math_dapo", "extra_info": {"index": 0}}      (label_key="reward_model.ground_truth")

A string prompt becomes one user message (after `system_prompt`, when given); a message list is used as it is.
`data_source` is read when present. Every other field goes into `PromptItem.metadata`, with the contents of
`extra_info` merged in, so a custom verifier sees them.

Every problem in the input is a `DatasetError` with one line naming the file, the row and the field. jsonl rows are
named by line (1-based, as editors count); parquet and saved-dataset rows by index (0-based, as `ds[i]` fetches
them). `validate_dataset` runs the same checks without a tokenizer, before any actor starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq

from entropy_openrlhf.samples import PromptItem

ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """Bad dataset input; the message is one line naming the file, row and field."""


def load_prompts(
    path: str,
    *,
    tokenizer: Any,
    input_key: str = "prompt",
    label_key: str = "label",
    apply_chat_template: bool = True,
    max_samples: int | None = None,
    system_prompt: str | None = None,
) -> list[PromptItem]:
    """Read `path` into PromptItems whose `prompt` is the exact engine input (chat template applied)."""
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"{path}: the tokenizer has no chat template; use data.apply_chat_template=false")
    items = []
    for index, (where, row) in enumerate(_rows(path)):
        if max_samples is not None and index >= max_samples:
            break
        prompt, label, data_source, metadata = _parse_row(path, where, row, input_key, label_key)
        messages = None
        if isinstance(prompt, str):
            if apply_chat_template:
                messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
                prompt = messages + [{"role": "user", "content": prompt}]
            elif system_prompt:
                prompt = f"{system_prompt}\n\n{prompt}"
        if isinstance(prompt, list):
            if not apply_chat_template:
                raise DatasetError(
                    f"{path}: {where}: field '{input_key}': a chat message list needs data.apply_chat_template=true"
                )
            messages = [dict(m) for m in prompt]
            # a list that ends with an assistant message starts the response: the template leaves that turn open
            # and generation continues it (a prefill, e.g. a tool call the episode runs first: docs/guides/tools.md)
            prefilled = bool(prompt) and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant"
            try:
                prompt = tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=not prefilled, continue_final_message=prefilled, tokenize=False
                )
            except Exception as e:  # a template may reject a role order; name the row
                raise DatasetError(
                    f"{path}: {where}: field '{input_key}': chat template failed: {_first_line(e)}"
                ) from None
        items.append(PromptItem(index, prompt, label, data_source, metadata, messages=messages))
    if not items:
        raise DatasetError(f"{path}: the dataset is empty (no rows)")
    return items


def validate_dataset(path: str, input_key: str = "prompt", label_key: str = "label") -> int:
    """Check every row of `path` as `load_prompts` would, without a tokenizer; return the number of rows."""
    n = 0
    for where, row in _rows(path):
        _parse_row(path, where, row, input_key, label_key)
        n += 1
    if n == 0:
        raise DatasetError(f"{path}: the dataset is empty (no rows)")
    return n


# ------------------------------------------------------------------------------------------------------ rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _rows(path: str) -> Iterator[tuple[str, Any]]:
    """Yield (where, row) for every row: `where` is "line N" for jsonl, "row N" otherwise."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{path}: no such file or folder")
    if p.is_dir():
        yield from _saved_dataset_rows(path)
    elif p.suffix in (".jsonl", ".json"):
        yield from _json_rows(path)
    elif p.suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise DatasetError(f"{path}: unknown format (expected .jsonl, .json, .parquet or a saved HF dataset folder)")


def _json_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        data = f.read()
    if data.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"[":  # a .json file holding one array of rows (a BOM first)
        try:
            rows = json.loads(data.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
        for i, row in enumerate(rows):
            yield f"row {i}", row
        return
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"{path}: line {number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
            ) from None
        if not line.strip():  # blank lines (a trailing newline, spacing) are not rows
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: line {number}: invalid JSON ({e.msg}, column {e.colno})") from None
        yield f"line {number}", row


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({_first_line(e)})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i}", row


def _saved_dataset_rows(path: str) -> Iterator[tuple[str, Any]]:
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise DatasetError(f"{path}: not a saved HF dataset folder ({_first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            splits = ", ".join(ds)
            raise DatasetError(f"{path}: holds several splits ({splits}); give the folder of one, e.g. {path}/train")
        ds = next(iter(ds.values()))
    for i, row in enumerate(ds):
        yield f"row {i}", row


# ------------------------------------------------------------------------------------------------------ fields


def _get(row: dict, key: str) -> Any:
    """`row[key]`, or a walk down dotted parts (`reward_model.ground_truth`); None when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _parse_row(
    path: str, where: str, row: Any, input_key: str, label_key: str
) -> tuple[str | list[dict], str, str, dict[str, Any]]:
    """Check one row; return (prompt string or message list, label, data_source, metadata)."""

    def fail(field: str, problem: str) -> DatasetError:
        return DatasetError(f"{path}: {where}: field '{field}': {problem}")

    if not isinstance(row, dict):
        raise DatasetError(f"{path}: {where}: a row must be an object with fields, not {type(row).__name__}")

    prompt = _get(row, input_key)
    if prompt is None:
        raise fail(input_key, "missing (or null)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise fail(input_key, "empty prompt")
    elif isinstance(prompt, list):
        _check_messages(prompt, lambda problem: fail(input_key, problem))
    else:
        raise fail(input_key, f"must be a string or a chat message list, not {type(prompt).__name__}")

    label = _get(row, label_key)
    if label is None:
        raise fail(label_key, "missing (or null)")
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise fail(label_key, f"must be a string or a number (one label per row), not {type(label).__name__}")
    label = str(label)
    if not label.strip():
        raise fail(label_key, "empty label")

    data_source = row.get("data_source")
    if data_source is None:
        data_source = ""
    elif not isinstance(data_source, str):
        raise fail("data_source", f"must be a string, not {type(data_source).__name__}")

    used = {input_key.split(".")[0], label_key.split(".")[0], "data_source", "extra_info"}
    metadata = {k: v for k, v in row.items() if k not in used}
    extra = row.get("extra_info")
    if isinstance(extra, dict):
        metadata.update(extra)
    elif extra is not None:
        raise fail("extra_info", f"must be an object, not {type(extra).__name__}")
    return prompt, label, data_source, metadata


def _check_messages(messages: list, fail: Any) -> None:
    if not messages:
        raise fail("empty prompt (no messages)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise fail(f"message {i} must be an object with role and content, not {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise fail(f"message {i} has role {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise fail(f"message {i} content must be a string, not {type(m.get('content')).__name__}")
    if not any(m["content"].strip() for m in messages):
        raise fail("empty prompt (every message is empty)")
