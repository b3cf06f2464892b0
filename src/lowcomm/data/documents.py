"""Finding and reading training text.

A *document* is ``(source_name, text)``. A *source* is one input file: a text file is one
document, a JSONL file holds one document per line. Sources matter for the validation split
(held out per source) and for non-IID sharding (workers get different sources).
"""

from __future__ import annotations

import gzip
import json
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


def _read_text(path: Path) -> str:
    # errors="replace": a stray invalid byte in a large scraped file should not stop training;
    # it becomes U+FFFD, which byte-level BPE handles like any other character.
    if path.name.lower().endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="") as handle:
            return handle.read()
    return path.read_text(encoding="utf-8", errors="replace")


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
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(
                f"--data: {path}:{line_number} has no field {text_field!r}; "
                f"pass --text-field with the field that holds the text"
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
