"""Finding and reading training text.

A *document* is ``(source_name, text)``. A *source* is one input file: a text file is one
document, a JSONL file holds one document per line. Sources matter for the validation split
(held out per source) and for non-IID sharding (workers get different sources).
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path

from lowcomm.data.config import DataError

BUNDLED_CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
"""The six Jane Austen novels shipped as package data."""

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")

Document = tuple[str, str]
"""``(source_name, text)``."""


def _has_suffix(path: Path, suffixes: tuple[str, ...]) -> bool:
    return path.name.lower().endswith(suffixes)


MAX_BAD_BYTE_FRACTION = 0.001
"""Text may hold at most this fraction of bytes that are not UTF-8 (or NUL), at least one byte:
a stray invalid byte in a large scraped file becomes U+FFFD and training goes on, but a file
with more is not UTF-8 text (binary, an executable, another encoding) and is refused."""


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _decode(path: Path, raw: bytes) -> str:
    """``raw`` as text, refusing (naming ``path``) what is not UTF-8 text."""
    nul = raw.count(b"\x00")
    if not nul:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            pass
    # surrogateescape turns each undecodable byte into one lone surrogate we can count.
    text = raw.decode("utf-8", errors="surrogateescape")
    invalid = len(_ESCAPED_BYTE.findall(text))
    bad = invalid + nul
    if bad > max(1, MAX_BAD_BYTE_FRACTION * len(raw)):
        what = f"{nul:,} NUL bytes" if nul > invalid else f"{invalid:,} bytes that are not UTF-8"
        raise DataError(
            f"--data: {path} is not UTF-8 text ({what} in {len(raw):,}, "
            f"{bad / len(raw):.1%}; at most {MAX_BAD_BYTE_FRACTION:.1%} is tolerated); pass "
            f"text files only, or convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        )
    return (
        text.encode("utf-8", errors="surrogateescape")
        .decode("utf-8", errors="replace")
        .replace("\x00", "\ufffd")
    )


def _read_text(path: Path) -> str:
    """The file's text: gzip-decompressed for ``.gz``; refused, naming the file, if it is not
    UTF-8 text beyond :data:`MAX_BAD_BYTE_FRACTION`."""
    try:
        if path.name.lower().endswith(".gz"):
            with gzip.open(path, "rb") as handle:
                raw = handle.read()
        else:
            raw = path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(
            f"--data: {path} is not a whole gzip file ({error}); pass a .txt.gz made by gzip, "
            f"or the uncompressed text"
        ) from None
    except OSError as error:
        raise DataError(f"--data: {path} cannot be read ({error.strerror or error})") from None
    return _decode(path, raw)


def _read_jsonl(path: Path, source_name: str, text_field: str) -> list[Document]:
    documents: list[Document] = []
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"--data: {path}:{line_number} is not valid JSON ({error.msg}); "
                f"each line of a .jsonl file must be one JSON object"
            ) from error
        if not isinstance(record, dict):
            raise DataError(
                f"--data: {path}:{line_number} is a JSON {type(record).__name__}, not a JSON "
                f"object; each line of a .jsonl file must be one object holding --text-field"
            )
        if text_field not in record:
            fields = ", ".join(repr(str(name)) for name in sorted(record)[:20]) or "none"
            more = f" and {len(record) - 20} more" if len(record) > 20 else ""
            raise DataError(
                f"--data: {path}:{line_number} has no field {text_field!r} (its fields: "
                f"{fields}{more}); pass --text-field with the field that holds the text"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(
                f"--data: {path}:{line_number} field {text_field!r} is "
                f"{type(text).__name__}, not a string; pass the field that holds the text"
            )
        if text:
            documents.append((source_name, text))
    return documents


def _read_file(path: Path, source_name: str, text_field: str) -> list[Document]:
    if _has_suffix(path, JSONL_SUFFIXES):
        return _read_jsonl(path, source_name, text_field)
    text = _read_text(path)
    return [(source_name, text)] if text else []


def list_source_files(data: str | None) -> list[tuple[str, Path]]:
    """Resolve ``--data`` into the files to read.

    Args:
        data: None for the bundled corpus, a file, or a folder (searched recursively).

    Returns:
        ``(source_name, path)`` pairs in a deterministic (sorted) order. A folder's sources are
        named by their path relative to the folder.

    Raises:
        DataError: If the path does not exist or a folder holds no usable files.
    """
    root = BUNDLED_CORPUS_DIR if data is None else Path(data).expanduser()
    if not root.exists():
        raise DataError(
            f"--data: path {data!r} does not exist; pass a text file, a folder of .txt/.jsonl "
            f"files, or omit --data to use the bundled corpus"
        )
    if root.is_file():
        return [(root.name, root)]
    files = sorted(
        path
        for path in root.rglob("*")
        if path.is_file() and _has_suffix(path, TEXT_SUFFIXES + JSONL_SUFFIXES)
    )
    if not files:
        raise DataError(
            f"--data: folder {str(root)!r} holds no .txt, .txt.gz or .jsonl files; "
            f"add some, pass a single file, or omit --data to use the bundled corpus"
        )
    return [(path.relative_to(root).as_posix(), path) for path in files]


def read_documents(data: str | None, text_field: str = "text") -> list[Document]:
    """Read every document of the configured input.

    Args:
        data: None for the bundled corpus, a file, or a folder (see :func:`list_source_files`).
        text_field: JSONL field that holds the text.

    Returns:
        The non-empty documents, in source order then file order.

    Raises:
        DataError: If the input is missing, malformed, or holds no text at all.
    """
    documents: list[Document] = []
    for source_name, path in list_source_files(data):
        documents.extend(_read_file(path, source_name, text_field))
    if not documents:
        raise DataError(
            f"--data: {data!r} holds no text (every file or JSONL record is empty); "
            f"pass a non-empty text file, or omit --data to use the bundled corpus"
        )
    return documents
