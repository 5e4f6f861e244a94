"""The part of HOCON that NVFlare's job configs use (objects, arrays, dotted keys, comments), read into dicts."""

from __future__ import annotations

import json
import re

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<comment>(?:\#|//)[^\n]*)
    | (?P<string>"(?:[^"\\]|\\.)*")
    | (?P<punct>[{}\[\]:=,])
    | (?P<newline>\n)
    | (?P<word>[^\s{}\[\]:=,"#]+(?:[ \t]+[^\s{}\[\]:=,"#]+)*)
    )""",
    re.VERBOSE,
)


class HoconError(ValueError):
    """Text this reader does not understand (substitutions, includes, or a syntax error)."""


def _tokens(text: str) -> list[tuple[str, str]]:
    found, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            if text[position:].strip() == "":
                break
            raise HoconError(f"cannot read {text[position : position + 20]!r}")
        position = match.end()
        kind = match.lastgroup
        if kind == "comment":
            continue
        found.append((kind, match.group(kind)))
    return found


def _scalar(kind: str, text: str):
    if kind == "string":
        return json.loads(text)
    if text.startswith("${"):
        raise HoconError(f"substitution {text} is not read")
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "null": None}.get(text, text)


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokens(text)
        self.index = 0

    def peek(self, skip_newlines: bool = True) -> tuple[str, str] | None:
        while skip_newlines and self.index < len(self.tokens) and self.tokens[self.index][0] == "newline":
            self.index += 1
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise HoconError("unexpected end of the file")
        self.index += 1
        return token

    def document(self) -> dict:
        token = self.peek()
        if token == ("punct", "{"):
            self.take()
            result = self.members("}")
        else:
            result = self.members(None)
        return result

    def members(self, closing: str | None) -> dict:
        table: dict = {}
        while True:
            token = self.peek()
            if token is None:
                if closing is not None:
                    raise HoconError("an object is not closed")
                return table
            if token == ("punct", closing):
                self.take()
                return table
            if token == ("punct", ","):
                self.take()
                continue
            kind, key = self.take()
            if kind not in ("word", "string"):
                raise HoconError(f"expected a key, found {key!r}")
            path = json.loads(key) if kind == "string" else key
            parts = [path] if kind == "string" else path.split(".")
            following = self.peek()
            if following in (("punct", ":"), ("punct", "=")):
                self.take()
            elif following != ("punct", "{"):
                raise HoconError(f"expected ':' or '=' after {key!r}")
            value = self.value()
            target = table
            for part in parts[:-1]:
                target = target.setdefault(part, {})
            if isinstance(value, dict) and isinstance(target.get(parts[-1]), dict):
                target[parts[-1]].update(value)  # HOCON merges objects given twice
            else:
                target[parts[-1]] = value

    def value(self):
        kind, text = self.take()
        if (kind, text) == ("punct", "{"):
            return self.members("}")
        if (kind, text) == ("punct", "["):
            items = []
            while True:
                token = self.peek()
                if token == ("punct", "]"):
                    self.take()
                    return items
                if token == ("punct", ","):
                    self.take()
                    continue
                items.append(self.value())
        if kind in ("word", "string"):
            return _scalar(kind, text)
        raise HoconError(f"unexpected {text!r}")


def parse_hocon(text: str) -> dict:
    return _Parser(text).document()
