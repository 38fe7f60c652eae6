"""Aligned English / Spanish Bible verses from Debian's SWORD modules (offline text).

Debian `sword-text-kjv` (King James, 2006 edition) and `sword-text-sparv`
(Reina-Valera 1909) are "zText" modules with the same KJV versification, so the
n-th index record of one is the same verse in the other. Per testament a module
has `.bzv` (10-byte records: uint32 block, uint32 offset, uint16 size), `.bzs`
(12-byte records: uint32 offset, uint32 compressed size, uint32 size) and
zlib-compressed blocks in `.bzz`. Verse text is OSIS markup; book headings carry
`<div ... osisID="Gen" ... type="book"/>`, which is how verses get their book
(the translation split is by book).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

SWORD_DIR = Path("/usr/share/sword/modules/texts/ztext")
ENGLISH = "engKJV2006eb"
SPANISH = "spaRV1909eb"
INSTALL_HINT = "install them with `apt-get install sword-text-kjv sword-text-sparv`"

_BOOK = re.compile(r'osisID="([^"]+)"[^>]*type="book"|type="book"[^>]*osisID="([^"]+)"')
_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,;:.!?)])")


@dataclass(frozen=True)
class VersePair:
    book: str  # OSIS book id, e.g. "Gen"
    index: int  # record index in the testament (same in both modules)
    testament: str  # "ot" or "nt"
    english: str
    spanish: str


def _records(module: str, testament: str, root: Path) -> list[str]:
    """Raw OSIS text of every index record of one testament of a zText module."""
    folder = root / module
    bzv = (folder / f"{testament}.bzv").read_bytes()
    bzs = (folder / f"{testament}.bzs").read_bytes()
    bzz = (folder / f"{testament}.bzz").read_bytes()
    blocks: dict[int, bytes] = {}
    out: list[str] = []
    for i in range(len(bzv) // 10):
        block, offset, size = struct.unpack_from("<IIH", bzv, i * 10)
        if size == 0:
            out.append("")
            continue
        if block not in blocks:
            start, csize, _ = struct.unpack_from("<III", bzs, block * 12)
            blocks[block] = zlib.decompress(bzz[start:start + csize])
        out.append(blocks[block][offset:offset + size].decode("utf-8", "replace"))
    return out


def plain_text(osis: str) -> str:
    """Verse text without notes and markup, whitespace collapsed."""
    text = " ".join(_TAG.sub("", _NOTE.sub(" ", osis)).split())
    return _SPACE_BEFORE_PUNCT.sub(r"\1", text)


def verse_pairs(root: Path = SWORD_DIR) -> list[VersePair]:
    """All verses present in both modules, in canonical order, tagged with their book."""
    if not (root / ENGLISH).is_dir() or not (root / SPANISH).is_dir():
        raise FileNotFoundError(f"SWORD modules {ENGLISH} / {SPANISH} not found under {root}; "
                                f"{INSTALL_HINT}")
    pairs: list[VersePair] = []
    for testament in ("ot", "nt"):
        en = _records(ENGLISH, testament, root)
        es = _records(SPANISH, testament, root)
        book = ""
        for i, (e, s) in enumerate(zip(en, es, strict=True)):
            m = _BOOK.search(e)
            if m:  # a book heading record, not a verse
                book = m.group(1) or m.group(2)
                continue
            e_text, s_text = plain_text(e), plain_text(s)
            if book and e_text and s_text:
                pairs.append(VersePair(book, i, testament, e_text, s_text))
    return pairs
