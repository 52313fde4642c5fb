"""Corpora any machine has without a download, for the capacity study (studies/capacity/README.md):

    python studies/capacity/corpora.py OUT_DIR     # writes OUT_DIR/{pystdlib,usrdoc}.txt, prints their sizes

- pystdlib: the running Python's standard library `.py` sources (sorted relative paths, tests and site-packages
  left out), concatenated, first CAP bytes. Code: a corpus whose statistics differ from prose.
- usrdoc: the Debian changelogs and READMEs under /usr/share/doc (sorted paths, .gz decompressed), first CAP
  bytes. English written by many hands; its content depends on the packages installed on the machine.
Tiny Shakespeare (Karpathy's char-rnn tinyshakespeare.txt, 1,115,394 bytes) is the third. Both files are rebuilt byte-identically on
the same machine; they are not committed.
"""

from __future__ import annotations

import gzip
import sys
import sysconfig
from pathlib import Path

CAP = 1_000_000  # bytes per corpus, about Tiny Shakespeare's size
DOCS = Path("/usr/share/doc")


def _joined(paths: list[Path], read) -> bytes:
    out = bytearray()
    for path in paths:
        try:
            out += read(path)
        except (OSError, EOFError):
            continue  # an unreadable file (a dangling link, a broken archive) is left out
        if len(out) >= CAP:
            break
    return bytes(out[:CAP])


def python_stdlib() -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    paths = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    return _joined(paths, lambda p: p.read_bytes())


def usr_share_doc() -> bytes:
    def wanted(p: Path) -> bool:
        name = p.name.lower()
        return p.is_file() and (name.startswith("changelog") or name.startswith("readme"))

    paths = sorted(p for p in DOCS.rglob("*") if wanted(p))
    return _joined(paths, lambda p: gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes())


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, build in [("pystdlib", python_stdlib), ("usrdoc", usr_share_doc)]:
        data = build()
        if len(data) < CAP // 2:
            raise SystemExit(f"{name}: only {len(data)} bytes found on this machine; the study needs about {CAP}")
        (out / f"{name}.txt").write_bytes(data)
        print(f"{out / name}.txt: {len(data)} bytes")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
