"""Parsing of ``--compression NAME[:key=value:...]``, pure and torch-free so config validation
can use it before any process starts.

Each compressor declares its options here with a type, a default and a check; an unknown name,
an unknown option or a value that fails its check raises ValueError listing what is valid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    kind: type
    default: Any
    check: Callable[[Any], bool]
    rule: str  # how the check reads to a user, e.g. "an integer >= 1"


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


SPECS: dict[str, dict[str, Option]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "topk": {
        "ratio": Option(float, 0.01, lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    },
    "powersgd": {
        "rank": Option(int, 4, lambda v: v >= 1, "an integer >= 1"),
        "warm_start": Option(bool, True, lambda v: True, "true or false"),
    },
    "sign": {},
}


def _describe(name: str) -> str:
    opts = SPECS[name]
    if not opts:
        return name
    return name + "[" + "".join(f":{k}={o.default}" for k, o in opts.items()).lower() + "]"


def valid_forms() -> str:
    return ", ".join(_describe(name) for name in SPECS)


def parse_compression(spec: str) -> tuple[str, dict[str, Any]]:
    """'powersgd:rank=2' -> ('powersgd', {'rank': 2, 'warm_start': True})."""
    name, *pairs = spec.strip().split(":") if spec.strip() else ["none"]
    if name not in SPECS:
        raise ValueError(f"compression: unknown compressor {name!r}; valid: {valid_forms()}")
    schema = SPECS[name]
    options = {key: opt.default for key, opt in schema.items()}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if key not in schema or not sep:
            valid = ", ".join(schema) or "none"
            raise ValueError(
                f"compression: {name} has no option {pair!r}; its options: {valid} "
                f"(valid forms: {valid_forms()})"
            )
        opt = schema[key]
        try:
            value = _bool(text) if opt.kind is bool else opt.kind(text)
        except ValueError:
            value = None
        if value is None or not opt.check(value):
            raise ValueError(f"compression: {name} {key} must be {opt.rule}, got {text!r}")
        options[key] = value
    return name, options
