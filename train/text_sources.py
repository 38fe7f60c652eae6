"""Offline text the prompts are built from, besides the Bible (`train.sword_bible`).

Everything here is read from what a Python + Debian machine already has:
- Python source files: the standard library and the installed packages;
- package descriptions: the README that every installed distribution carries
  in its metadata (long passages for summarization and questions);
- software message catalogs: the gettext `.mo` files of Debian packages, whose
  English messages and their translations are short technical texts in many
  languages (a genre beside the Bible verses).
Each reader returns items tagged with the unit the train/held-out split uses.
"""

from __future__ import annotations

import ast
import gettext
import re
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

_SKIP_PARTS = frozenset({"test", "tests", "idlelib", "testing", "_vendor", "vendored"})
LANGUAGES = {"es": "Spanish", "fr": "French", "de": "German", "it": "Italian",
             "pt_BR": "Portuguese"}
_WORD = re.compile(r"[A-Za-z]{3,}")


@dataclass(frozen=True)
class Function:
    unit: str  # the module file, relative to its root ("stdlib/json/decoder.py")
    name: str
    source: str
    doc: str  # first docstring paragraph


def python_files() -> list[tuple[str, Path]]:
    """(unit, path) of the standard library's and the installed packages' modules."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"])), ("site", Path(paths["purelib"]))]
    out = []
    for tag, root in roots:
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root)
            if _SKIP_PARTS & set(rel.parts) or (tag == "stdlib" and "site-packages" in rel.parts):
                continue
            out.append((f"{tag}/{rel}", p))
    return out


def documented_functions(unit: str, path: Path, limit: int = 3) -> list[Function]:
    """Up to `limit` documented public top-level functions of 150-1,200 characters."""
    try:
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        code = ast.get_source_segment(src, node)
        if doc and code and 150 <= len(code) <= 1200:
            out.append(Function(unit, node.name, code, doc.strip().split("\n\n")[0]))
        if len(out) == limit:
            break
    return out


def package_readmes(min_chars: int = 1500) -> list[tuple[str, str, str]]:
    """(distribution name, one-line summary, README text) of installed distributions."""
    seen: set[str] = set()
    out = []
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        body = dist.metadata.get_payload() or ""  # type: ignore[attr-defined]
        if not name or name in seen or len(body) < min_chars:
            continue
        seen.add(name)
        out.append((name, dist.metadata["Summary"] or "", body.strip()))
    return sorted(out)


def message_catalogs(roots: tuple[str, ...] = ("/usr/share/locale",)
                     ) -> list[tuple[str, str, str, str]]:
    """(domain, language, English message, translation) from gettext catalogs.

    Kept: messages of 25-300 characters with at least four words, no format-only
    or markup strings; plural entries are skipped. The split unit is the domain
    (the package's catalog name), so a domain's messages stay in one split.
    """
    out = []
    for root in roots:
        for lang in LANGUAGES:
            d = Path(root) / lang / "LC_MESSAGES"
            for mo in sorted(d.glob("*.mo")) if d.is_dir() else []:
                if mo.stem.startswith("iso_"):  # country and language names only
                    continue
                try:
                    with mo.open("rb") as f:
                        catalog = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
                except (OSError, UnicodeDecodeError, ValueError):
                    continue
                for en, tr in catalog.items():
                    if (isinstance(en, str) and isinstance(tr, str) and en and tr != en
                            and 25 <= len(en) <= 300 and len(_WORD.findall(en)) >= 4
                            and "<" not in en and "\x00" not in en):
                        out.append((mo.stem, lang, " ".join(en.split()), " ".join(tr.split())))
    return out
