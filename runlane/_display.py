"""How an error message shows a value the caller gave: its repr, cut to a bound.

A 10,000-character task id or key repeated whole makes the message (and every log line that
carries it) unreadable; ``repr()`` of an integer over 4,300 digits, or of a user type, may
even raise while the error is being built.
"""

from __future__ import annotations

__all__ = ["MAX_SHOWN_CHARS", "clipped", "count_of", "noun_for", "shown"]

MAX_SHOWN_CHARS = 100


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)``, or its start and a count when longer than ``limit`` characters; a
    description instead when ``repr()`` fails."""
    if isinstance(value, str) and len(value) > limit:  # no repr() of the whole string
        return f"a string of {len(value):,} characters starting {value[: limit // 2]!r}"
    try:
        text = repr(value)
    except Exception:  # a user type's __repr__, or an int too long to print
        if isinstance(value, int):
            return f"an integer of {value.bit_length():,} bits"
        return f"a {type(value).__name__} (its repr() failed)"
    if len(text) <= limit:
        return text
    if isinstance(value, int) and text.lstrip("-").isdigit():
        return f"an integer of {len(text.lstrip('-')):,} digits"
    return f"{text[:limit]}... ({len(text):,} characters)"


def clipped(text: str, limit: int = 300) -> str:
    """``text`` (a message, not a value: no quotes added), cut to ``limit`` characters."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` agreeing in number, as the CLI and the console print counts:
    ``1 run``, ``0 runs``, ``20,000 runs`` (``plural`` when not ``noun + "s"``)."""
    return f"{n:,} {noun_for(n, noun, plural)}"


def noun_for(n: int, noun: str, plural: str | None = None) -> str:
    """``noun`` when ``n`` is 1, else its plural (``plural``, or ``noun + "s"``)."""
    return noun if n == 1 else plural or noun + "s"
