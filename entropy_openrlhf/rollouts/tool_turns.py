"""The text side of a tool episode (`--rollout.function python_tool`): where a tool call ends, what code it holds,
what the model reads back, and the token ids of that tool turn.

The call format is a fenced Python block, the last thing in the model's turn:

    ...some reasoning
    ```python
    print(37 * 41)
    ```

The engine generates with the stop string `STOP` (a closing fence on a line of its own), so a call ends the request
right after its closing fence; a turn that ends in a closed block followed by end-of-sequence is a call too (what a
chat model does when its template closes the assistant turn before a tool's). Anything else is the final answer.

Token in, token out: the ids the policy sampled are never re-tokenised. Only the tool turn is, and only its own text:
the chat template's delimiters around a tool message, found by suffix difference (the template applied to a
conversation with a placeholder assistant turn, with and without a tool message after it), with the tool's output
in between. The output is tokenised with special tokens split, so code that prints `<|im_end|>` cannot forge a turn
boundary. Without a chat template (a plain-text prompt) the tool turn is a fenced ```output block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from entropy_openrlhf.tools.sandbox import SandboxResult

OPEN = "```python"
STOP = "\n```\n"  # the engine's stop string: a closing fence on its own line (an opening one has a language)
_BLOCK = re.compile(r"```python[ \t]*\n(.*?)\n?```\s*", re.S)
_PLACEHOLDER = "\x1fTOOL-OUTPUT\x1f"  # never in a template: where the tool's output goes
_ANSWER = "\x1fASSISTANT\x1f"  # the placeholder assistant turn the delimiters are measured around


def tool_call(text: str) -> str | None:
    """The code of the tool call `text` (one model turn) ends with, or None when it ends with none: a fenced
    ```python block closed at the very end (trailing whitespace aside)."""
    start = text.rfind(OPEN)
    match = _BLOCK.fullmatch(text, start) if start >= 0 else None
    if match is None:
        return None
    code = match.group(1)
    return code if code.strip() else None


def observation(result: SandboxResult) -> str:
    """What the model reads back from a call: its stdout, then, when it failed, its stderr and why it stopped."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if not result.ok:
        if result.stderr.strip():
            parts.append(result.stderr.rstrip("\n"))
        if result.timed_out:
            parts.append("(timed out)")
        elif result.truncated:
            parts.append("(output cut)")
        elif result.exit_code != 0:
            parts.append(f"(exit code {result.exit_code})")
    return "\n".join(parts) if parts else "(no output)"


@dataclass(frozen=True)
class _Delimiters:
    close: str  # what ends the assistant's turn (the template's, e.g. "<|im_end|>\n")
    before: str  # from there to the tool's output (e.g. "<|im_start|>tool\n")
    after: str  # from the output to the next assistant turn's first token (e.g. "<|im_end|>\n<|im_start|>assistant\n")


class ToolTurns:
    """Token ids of tool turns for one tokenizer (module docstring). `ids(output, chat=..., ended_with=...)`: the
    turn's ids; `ended_with` is the text of the token the policy's turn ended on when that was end-of-sequence (its
    template's close of the turn is then partly sampled already, and not repeated)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # the role the template's tool turn is rendered as: "tool", or "user" where the template has no tool role
        self.role = ""
        self.chat = self._chat_delimiters() if getattr(tokenizer, "chat_template", None) else None
        self.plain = _Delimiters("", "```output\n", "\n```\n")

    def ids(self, output: str, *, chat: bool, ended_with: str | None = None) -> list[int]:
        d = self.chat if chat and self.chat is not None else self.plain
        close = d.close
        if ended_with and close.startswith(ended_with):
            close = close[len(ended_with) :]
        encode = self.tokenizer
        head = encode(close + d.before, add_special_tokens=False)["input_ids"]
        body = encode(output, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        tail = encode(d.after, add_special_tokens=False)["input_ids"]
        return head + body + tail

    def _chat_delimiters(self) -> _Delimiters | None:
        """The template's delimiters around a tool message, by suffix difference; the role `tool`, or `user` for a
        template that refuses it; None when the template's renderings do not nest (then the plain format)."""
        base = [{"role": "user", "content": "x"}]
        answer = {"role": "assistant", "content": _ANSWER}
        for role in ("tool", "user"):
            try:
                opened = self._render(base, generation_prompt=True)
                answered = self._render([*base, answer], generation_prompt=False)
                followed = self._render(
                    [*base, answer, {"role": role, "content": _PLACEHOLDER}], generation_prompt=True
                )
            except Exception:  # noqa: BLE001 - a template that raises on this role: try the next
                continue
            if not (answered.startswith(opened + _ANSWER) and followed.startswith(answered)):
                return None
            tool_part = followed[len(answered) :]
            if tool_part.count(_PLACEHOLDER) != 1:
                return None
            before, after = tool_part.split(_PLACEHOLDER)
            self.role = role
            return _Delimiters(answered[len(opened) + len(_ANSWER) :], before, after)
        return None

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
