"""Configuration and errors for the data pipeline."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("iid", "non-iid")
"""Values accepted by :attr:`DataConfig.split`."""

MIN_VOCAB_SIZE = 258
"""Byte-level BPE starts from 256 byte tokens plus the end-of-text token, so anything smaller
could not even hold the initial alphabet."""

MAX_VOCAB_SIZE = 1 << 20
"""Generous upper bound that still catches typos such as an extra zero or two."""

TOKEN_FILE_SUFFIXES = (".npy", ".bin")
"""``--data`` files of token ids (mapped, not tokenized)."""

TOKEN_DTYPES = ("uint16", "uint32")
"""Values accepted by :attr:`DataConfig.data_dtype`, and the dtypes a ``.npy`` may hold."""

CACHE_DIR_ENV = "LOWCOMM_CACHE_DIR"
"""Environment variable giving the cache directory when :attr:`DataConfig.cache_dir` is None."""


class DataError(ValueError):
    """The training data cannot be read or is unusable as configured."""


@dataclass
class DataConfig:
    """Where the training text comes from, how it is tokenized, and how it is split."""

    data: str | None = None
    """Training data: None for the bundled Jane Austen corpus; a .txt, .txt.gz, .jsonl or
    .parquet file, a folder searched recursively (sorted) for such files, or a dataset saved
    with datasets' save_to_disk (text tokenized once into a token file in the cache); or a file
    of token ids, .npy or raw .bin (with --data-dtype), mapped as it is (needs --tokenizer)."""

    data_dtype: str | None = None
    """Width of the ids in a raw .bin token file: uint16 (nanoGPT's) or uint32. A .npy file's
    header gives its own."""

    text_field: str = "text"
    """Field holding the document text in each JSONL object."""

    vocab_size: int = 2048
    """Target size of the byte-level BPE vocabulary (a tiny corpus may yield fewer tokens)."""

    val_fraction: float = 0.05
    """Fraction at the end of every source's token stream held out for validation."""

    split: str = "iid"
    """How training windows are dealt to workers: iid (random) or non-iid (contiguous blocks,
    so each worker sees mostly one or two sources)."""

    micro_batch_size: int = 8
    """Sequences per micro-batch on each worker."""

    tokenizer: str | None = None
    """A tokenizer.json to tokenize with instead of training a BPE (--vocab-size is then
    unused). None: with --init-from, the model's own tokenizer.json, else a BPE trained on the
    data."""

    end_of_text: str | None = None
    """The token placed after every document (the model sees document boundaries). None: for a
    trained BPE <|endoftext|>; for --tokenizer its <|endoftext|> if it has one, else the
    eos_token of the tokenizer_config.json beside it, else the first of </s>,
    <|end_of_text|>, <eos> it has. Pre-flight records the choice in config.json."""

    cache_dir: str | None = None
    """Cache for tokenizers and tokenized corpora; None means $LOWCOMM_CACHE_DIR if set,
    else ~/.cache/lowcomm."""

    def __post_init__(self) -> None:
        if self.data is not None and not str(self.data).strip():
            raise DataError(
                "--data: '' is an empty path; pass a text file or folder, "
                "or omit --data to use the bundled corpus"
            )
        if self.data_dtype is not None:
            self._check_data_dtype()
        if not isinstance(self.text_field, str) or not self.text_field:
            raise DataError(
                f"--text-field: {self.text_field!r} is not a non-empty string; "
                f"pass the JSONL field holding the text, such as 'text'"
            )
        if (
            isinstance(self.vocab_size, bool)
            or not isinstance(self.vocab_size, int)
            or not MIN_VOCAB_SIZE <= self.vocab_size <= MAX_VOCAB_SIZE
        ):
            raise DataError(
                f"--vocab-size: {self.vocab_size!r} is outside "
                f"[{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}] (256 byte tokens plus end-of-text is the "
                f"minimum); pass a size such as 2048"
            )
        if self.tokenizer is not None and not str(self.tokenizer).strip():
            raise DataError(
                "--tokenizer: '' is an empty path; pass a tokenizer.json, or omit --tokenizer"
            )
        if self.end_of_text is not None and (
            not isinstance(self.end_of_text, str) or not self.end_of_text.strip()
        ):
            raise DataError(
                f"--end-of-text: {self.end_of_text!r} is not a token; pass one of the "
                f"tokenizer's special tokens, such as '</s>', or omit it"
            )
        if not 0.0 < self.val_fraction <= 0.5:
            raise DataError(
                f"--val-fraction: {self.val_fraction} is outside (0, 0.5]; "
                f"pass a fraction such as 0.05"
            )
        if self.split not in SPLITS:
            raise DataError(
                f"--split: unknown split {self.split!r}; choose one of {', '.join(SPLITS)}"
            )
        if (
            isinstance(self.micro_batch_size, bool)
            or not isinstance(self.micro_batch_size, int)
            or self.micro_batch_size < 1
        ):
            raise DataError(
                f"--micro-batch-size: {self.micro_batch_size!r} is not a positive integer; "
                f"pass an integer >= 1 such as 8"
            )

    def _check_data_dtype(self) -> None:
        if self.data_dtype not in TOKEN_DTYPES:
            raise DataError(
                f"--data-dtype: {self.data_dtype!r} is not a token id dtype; pass one of "
                f"{', '.join(TOKEN_DTYPES)}"
            )
        if self.data is None or not str(self.data).lower().endswith(TOKEN_FILE_SUFFIXES):
            raise DataError(
                f"--data-dtype: {self.data_dtype} given, but --data "
                f"{'(the bundled corpus)' if self.data is None else repr(self.data)} is not a "
                f".bin or .npy file of token ids; omit --data-dtype"
            )

    def resolved_cache_dir(self) -> Path:
        """Return the cache directory this configuration uses.

        Returns:
            ``cache_dir`` if set, else ``$LOWCOMM_CACHE_DIR`` if set, else ``~/.cache/lowcomm``.
        """
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        from_environment = os.environ.get(CACHE_DIR_ENV)
        if from_environment:
            return Path(from_environment).expanduser()
        return Path.home() / ".cache" / "lowcomm"
