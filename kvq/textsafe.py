"""Untrusted text made safe for a terminal.

Strings from a manifest, a model config, a tokenizer or a dataset are data: an escape
sequence in an artifact's name must not clear the screen, set the window title or write
the clipboard (OSC 52), and a bidi override must not reorder what the user reads. Every
control, format, surrogate, private-use or unassigned character is shown as its Python
escape instead (`\\x1b`, `\\u202e`). Rich markup is a separate matter: print such text as
`rich.text.Text`, never inside a markup string.
"""

from __future__ import annotations

import unicodedata


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with every non-printing character escaped; newlines and tabs too unless
    `keep_newlines` (generated text keeps its line structure)."""
    if text.isprintable():
        return text
    return "".join(_escape(ch, keep_newlines) for ch in text)


def _escape(ch: str, keep_newlines: bool) -> str:
    if keep_newlines and ch in "\n\t":
        return ch
    if ch == " " or not unicodedata.category(ch).startswith(("C", "Zl", "Zp")):
        return ch
    return ch.encode("unicode_escape", errors="backslashreplace").decode("ascii")
