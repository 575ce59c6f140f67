"""Tool calls in a chat model's text, parsed into OpenAI's `tool_calls`, whole or as they stream.

Two formats, as the chat templates that train them write them (vLLM's `hermes` and `llama3_json` parsers):

    hermes       (Qwen2/2.5, Hermes, Mistral-Hermes)  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  (Llama 3.1 / 3.2)                    {"name": "f", "parameters": {...}}  (after <|python_tag|>, or
                                                      the whole reply; several joined by ";")

`style_of(template)` picks the format from the chat template's own text. Text outside the calls is the message's
content. A streamed reply holds back what could still be the start of a call, so no piece of one is ever sent as
content; each call is sent whole (its name and arguments in one delta) once it has closed.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

STYLES = ("hermes", "llama3_json")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def style_of(template_source: str | None) -> str | None:
    """The tool-call format a chat template teaches, or None when it shows no tools."""
    if not template_source or "tools" not in template_source:
        return None
    if OPEN in template_source:
        return "hermes"
    return "llama3_json"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def as_json(self, index: int | None = None) -> dict:
        out = {"id": self.id or "call_" + secrets.token_hex(12), "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


def _call(obj, key: str) -> ToolCall | None:
    """A {"name": str, key: object} dict as a call, else None."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(key, {}), dict)):
        return None
    return ToolCall(obj["name"], json.dumps(obj.get(key, {}), ensure_ascii=False))


def _json_objects(text: str) -> list | None:
    """The JSON values of `text` written one after another (separated by blanks, ";" or ","), or None."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            return out
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        out.append(value)


def parse(text: str, style: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; a reply whose calls do not parse is all content."""
    if style == "hermes":
        content, calls, at = [], [], 0
        while (start := text.find(OPEN, at)) >= 0:
            end = text.find(CLOSE, start)
            body = text[start + len(OPEN):end if end >= 0 else len(text)]
            values = _json_objects(body)
            found = [c for c in (_call(v, "arguments") for v in values or []) if c is not None]
            if not values or len(found) != len(values):
                break
            content.append(text[at:start])
            calls += found
            at = end + len(CLOSE) if end >= 0 else len(text)
        content.append(text[at:])
        joined = "".join(content).strip()
        return (joined or None) if calls else text, calls
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    values = _json_objects(body)
    found = [c for c in (_call(v, "parameters" if "parameters" in v else "arguments") for v in values or [])
             if c is not None] if values else []
    if not values or len(found) != len(values):
        return text, []
    return None, found


class StreamParser:
    """A streamed reply's text pieces in, (content to send, calls that closed) out."""

    def __init__(self, style: str):
        self.style = style
        self.text = ""  # everything so far
        self.sent = 0  # content sent, in characters of `text`
        self.calls = 0  # calls sent
        self.json_reply: bool | None = None  # llama3_json: whether the reply is calls (known at its first character)

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.text += piece
        if self.style == "hermes":
            return self._hermes(final=False)
        if self.json_reply is None:
            lead = self.text.lstrip()
            if PYTHON_TAG.startswith(lead):  # nothing yet, or what may still become the tag: wait
                return "", []
            lead = lead.removeprefix(PYTHON_TAG).lstrip()
            if not lead:
                return "", []
            self.json_reply = lead.startswith("{")
        if self.json_reply:
            return "", []  # the whole reply is calls: parsed at the end
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the reply."""
        if self.style == "hermes":
            return self._hermes(final=True)
        if self.json_reply is False:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        content, calls = parse(self.text, self.style)
        return (content or "") if not calls else "", calls

    def _hermes(self, final: bool) -> tuple[str, list[ToolCall]]:
        out, calls = "", []
        while True:
            rest = self.text[self.sent:]
            start = rest.find(OPEN)
            if start < 0:
                keep = 0 if final else next((k for k in range(min(len(OPEN) - 1, len(rest)), 0, -1)
                                             if OPEN.startswith(rest[-k:])), 0)
                out += rest[:len(rest) - keep]
                self.sent += len(rest) - keep
                return out, calls
            end = rest.find(CLOSE, start)
            if end < 0 and not final:
                out += rest[:start]
                self.sent += start
                return out, calls
            body = rest[start + len(OPEN):end if end >= 0 else len(rest)]
            values = _json_objects(body) or []
            found = [c for c in (_call(v, "arguments") for v in values) if c is not None]
            if not values or len(found) != len(values):  # not a call after all: its text is content
                out += rest[:end + len(CLOSE) if end >= 0 else len(rest)]
            else:
                out += rest[:start]
                calls += found
            self.sent += end + len(CLOSE) if end >= 0 else len(rest)


def forced_schema(tools: list[dict], choice, parallel: bool = True) -> dict:
    """The JSON schema a forced tool choice generates (vLLM's way): a named function's parameters, or for "required"
    a list of {"name", "parameters"} objects, one of the tools each (at most one unless parallel)."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if isinstance(choice, str) and choice != "required":
        return params[choice]
    one = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"], "additionalProperties": False} for name, schema in params.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one}} | ({} if parallel else {"maxItems": 1})


class Reply:
    """A chat choice's text as it comes, turned into content and tool calls.

    mode: ("auto", style) parses the model's own tool-call format; ("named", name) reads the whole text as that
    function's arguments; ("required",) reads it as a list of {"name", "parameters"} (both forced by a grammar)."""

    def __init__(self, mode: tuple):
        self.mode, self.text = mode, ""
        self.stream = StreamParser(mode[1]) if mode[0] == "auto" else None

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.text += piece
        return self.stream.feed(piece) if self.stream is not None else ("", [])

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.stream is not None:
            return self.stream.finish()
        content, calls = whole(self.text, self.mode)
        return content or "", calls


def whole(text: str, mode: tuple) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply in `mode` (see Reply); text that is not the calls stays content."""
    if mode[0] == "auto":
        return parse(text, mode[1])
    try:
        value = json.loads(text)
    except ValueError:  # the grammar did not finish (max_tokens): the text as it is
        return text, []
    if mode[0] == "named":
        return (None, [ToolCall(mode[1], json.dumps(value, ensure_ascii=False))]) if isinstance(value, dict) else (text, [])
    calls = [_call(v, "parameters") for v in value] if isinstance(value, list) else [None]
    return (None, calls) if calls and None not in calls else (text, [])  # type: ignore[return-value]
