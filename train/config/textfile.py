"""Line-based text inputs (metadata.jsonl, edit lists, validation files, term lists) read as an editor shows them.

Lines are split on '\\n' only (a CRLF's '\\r' is dropped): `str.splitlines` also splits on form feeds, vertical tabs,
U+2028 and other separators that editors show inside a line, which shifted every later reported line number. A
UTF-8 byte order mark is skipped (as the CSV reader does), and a file that is not UTF-8 is a named error.
"""

from __future__ import annotations

from pathlib import Path


class TextFileError(ValueError):
    """A text input that cannot be read; the message names the file, the line and the fix."""


def read_text(path: str | Path) -> str:
    """The file as text (UTF-8, BOM skipped); TextFileError naming the line of the first undecodable byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TextFileError(f"{path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                            "save the file as UTF-8") from None


def lines(path: str | Path) -> list[tuple[int, str]]:
    """(1-based line number, text) of every line, numbered as an editor numbers them."""
    text = read_text(path)
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()  # the final newline ends the last line; it starts no new one
    return [(n, part.removesuffix("\r")) for n, part in enumerate(parts, start=1)]
