r"""Generated tokens shown as text that round-trips: no replacement characters, nothing hidden.

An untrained model emits any token, and a byte-level tokenizer has one token per byte: a lone
``0xE2`` is half a character, and ``tokenizer.decode`` turns it into U+FFFD (``sea�um``), losing
which byte it was. :func:`readable` decodes the tokens' bytes as UTF-8 and writes every byte that is
not part of a valid character, and every control character, as a Python-style escape (``\xe2``,
``\x07``, ``\n``); a backslash is written ``\\``. :func:`original_bytes` reads such text back into
the exact bytes, so what the demo prints is what the model produced.

Example:
    >>> readable(b"sea\xe2um")
    'sea\\xe2um'
    >>> readable("café 🐟\tok".encode())
    'café 🐟\\tok'
    >>> original_bytes(readable(b"sea\xe2um \\ \x07")) == b"sea\xe2um \\ \x07"
    True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["original_bytes", "readable", "token_bytes"]

_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\"}
_ESCAPE = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[ntr\\])")
# A sentencepiece byte-fallback token (Llama, Gemma, Mistral): "<0xE2>".
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def readable(data: bytes) -> str:
    r"""``data`` as printable text: UTF-8 characters as they are, anything else escaped.

    Args:
        data: the bytes to show.

    Returns:
        Text with only printable characters and spaces; :func:`original_bytes` gives ``data`` back.

    Example:
        >>> readable(b"bell\x07 \xff")
        'bell\\x07 \\xff'
    """
    out = []
    text = data.decode("utf-8", errors="surrogateescape")  # an invalid byte B becomes U+DC00+B
    for char in text:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char in _NAMED:
            out.append(_NAMED[char])
        elif char.isprintable():
            out.append(char)
        elif code < 0x80:  # \xNN always means one byte: only ASCII controls use it
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


def original_bytes(text: str) -> bytes:
    r"""The bytes :func:`readable` was given, from its text.

    Args:
        text: output of :func:`readable`.

    Returns:
        The original bytes.

    Example:
        >>> original_bytes("sea\\xe2um")
        b'sea\xe2um'
    """
    out = bytearray()
    pos = 0
    for match in _ESCAPE.finditer(text):
        out += text[pos : match.start()].encode()
        code = match.group(1)
        if code[0] == "x":
            out.append(int(code[1:], 16))  # a raw byte (below 0x80: a control character)
        elif code[0] in "uU":
            out += chr(int(code[1:], 16)).encode()
        else:
            out += {"n": b"\n", "t": b"\t", "r": b"\r", "\\": b"\\"}[code]
        pos = match.end()
    out += text[pos:].encode()
    return bytes(out)


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the tokenizers / transformers table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> bytes:
    """The bytes a sequence of token ids stands for, special tokens left out.

    Byte-level BPE tokens (GPT-2, Qwen, Llama 3, the demo's tiny tokenizer) map character by
    character onto bytes, and sentencepiece byte-fallback tokens (``<0xE2>``) are one byte each;
    any other tokenizer's decoded text is taken as it is, encoded as UTF-8.

    Args:
        tokenizer: a transformers tokenizer.
        ids: token ids.

    Returns:
        The bytes, for :func:`readable`.
    """
    # An id past the vocabulary has no token (None) and no text: left out, as tokenizer.decode does.
    tokens = [
        t for t in tokenizer.convert_ids_to_tokens(list(ids), skip_special_tokens=True) if t is not None
    ]
    alphabet = _byte_level_alphabet()
    if all(char in alphabet for token in tokens for char in token):
        return bytes(alphabet[char] for token in tokens for char in token)
    if any(_BYTE_TOKEN.fullmatch(token) for token in tokens):
        out = bytearray()
        run: list[str] = []  # ordinary tokens between byte tokens, decoded together
        for token in [*tokens, None]:
            match = _BYTE_TOKEN.fullmatch(token) if token is not None else None
            if match is None and token is not None:
                run.append(token)
                continue
            if run:
                out += tokenizer.convert_tokens_to_string(run).encode()
                run = []
            if match is not None:
                out.append(int(match.group(1), 16))
        return bytes(out)
    return str(tokenizer.decode(list(ids), skip_special_tokens=True)).encode()
