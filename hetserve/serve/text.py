"""Text in and out: tokenizing prompts, rendering chats, streaming detokenization, stop strings.

``Codec`` is the small tokenizer interface the server needs (a Hugging Face tokenizer fits it via
``HFCodec``); ``TextStream`` turns a stream of token ids into text deltas that never split a
multi-byte character and never show the start of a stop string that later completes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol, Sequence

from hetserve.errors import SpecError

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback
_SPACE_MARK = "\u2581"  # sentencepiece's space in a piece


class Codec(Protocol):
    """``max_token_chars`` (optional; None or absent: unknown): no token covers more characters of
    text, so a text of n characters has at least n / max_token_chars tokens."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` stands for (OpenAI's logprob ``bytes``): a piece of a multi-byte
        character is its own bytes, not those of its text alone (U+FFFD)."""
        ...


def default_chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """A plain chat layout for checkpoints without a chat template: one ``role: text`` line each,
    then ``assistant:`` for the model to continue."""
    return "".join(f"{role}: {text}\n" for role, text in messages) + "assistant:"


def _config_for_tokenizer(model_dir: Path):
    """The folder's config.json as transformers' base config class, for ``AutoTokenizer``, where its
    tokenizer_config.json names the tokenizer class and neither file asks for remote code: the
    tokenizer then comes out as with the model's own config class, whose module imports torch's
    compiler stack (6-9 s of CPU per process on a slow host). Otherwise None: ``AutoTokenizer``
    loads the config itself."""
    try:
        tokenizer_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        model_cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(tokenizer_cfg, dict) and isinstance(model_cfg, dict)):
        return None
    if not tokenizer_cfg.get("tokenizer_class") or "auto_map" in tokenizer_cfg or "auto_map" in model_cfg:
        return None  # no class named, or remote code: AutoTokenizer's own path
    from transformers import PreTrainedConfig

    try:
        config = PreTrainedConfig.from_dict(model_cfg)
    except Exception:  # noqa: BLE001 - whatever the base class refuses, AutoTokenizer's own path judges
        return None
    config._name_or_path = str(model_dir)  # as AutoConfig sets it: AutoTokenizer matches some names
    return config


class HFCodec:
    """A Hugging Face tokenizer (``AutoTokenizer.from_pretrained(model_dir)``) as a ``Codec``."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self._max_token_chars: int | None = None
        self._byte_of: dict[str, int] | None = None  # byte-level BPE: a piece's character -> its byte
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        # sentencepiece spells a space as U+2581 in its pieces; its decoder turns it back (and may strip
        # the text's first space, so a piece decoded alone loses it)
        state = decoder.__getstate__() if decoder is not None else b""
        self._spaces_marked = _SPACE_MARK.encode() in state and b'"ByteLevel"' not in state
        if type(decoder).__name__ == "ByteLevel":
            from hetserve.runtime.model.make import bytes_to_unicode

            self._byte_of = {ch: b for b, ch in bytes_to_unicode().items()}

    # a normalizer may fold a few characters of input into one (NFC composes a letter and its accents)
    _NORMALIZER_SLACK = 4

    @property
    def max_token_chars(self) -> int | None:
        """A bound on the input characters one token covers: the longest vocabulary entry, in
        characters, times ``_NORMALIZER_SLACK``. A vocabulary entry spells its text at least as long as
        the normalized text it covers (byte-level BPE: one character per byte; sentencepiece: the text
        with ``▁`` for a space). O(vocabulary) once."""
        if self._max_token_chars is None:
            try:
                vocab = self.tok.get_vocab()
            except (AttributeError, NotImplementedError):
                return None
            longest = max((len(t) for t in vocab), default=0)
            self._max_token_chars = longest * self._NORMALIZER_SLACK or None
        return self._max_token_chars

    @staticmethod
    def from_dir(model_dir: str | Path) -> "HFCodec":
        """The folder's tokenizer; one that transformers cannot load is a ``SpecError`` naming the folder."""
        from transformers import AutoTokenizer

        try:
            return HFCodec(AutoTokenizer.from_pretrained(str(model_dir), config=_config_for_tokenizer(Path(model_dir))))
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises for the files it reads
            raise SpecError(str(model_dir), "tokenizer", "a tokenizer transformers can load (tokenizer.json, "
                            "tokenizer_config.json)", f"{type(exc).__name__}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        # an over-long prompt is refused with a 400 of the engine's own (policies.request_checks);
        # transformers' warning about the same length would only be noise in the server's log
        return list(self.tok.encode(text, add_special_tokens=False, verbose=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of ``token``'s vocabulary entry, so that a multi-byte character split over
        tokens joins back (its text alone is U+FFFD): byte-level BPE spells each byte as one
        character (GPT-2's map), sentencepiece a fallback byte as ``<0xNN>`` and a space as U+2581
        (``▁word`` is `` word``, though decoded alone it is ``word``). A special token, or any other
        entry, is its decoded text."""
        piece = self.tok.convert_ids_to_tokens(int(token))
        if isinstance(piece, str) and token not in self._special:
            byte_of = self._byte_of
            if byte_of is not None and all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
            fallback = _BYTE_PIECE.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if self._spaces_marked:
                return piece.replace(_SPACE_MARK, " ").encode("utf-8")
        return self.decode([token]).encode("utf-8")

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                                tokenize=False, add_generation_prompt=True)
        return default_chat_prompt(messages)


class TextStream:
    """Incremental detokenizer with stop strings.

    ``push(token_id)`` returns the text that may be shown now; ``stopped`` turns True once a stop
    string appears (the text before it is all that is ever shown). ``finish()`` flushes what was
    held back. Decoding re-reads at most the last few tokens (vLLM's prefix/read offsets), so a
    token costs O(1) decode work, not O(length).
    """

    _WINDOW = 6  # tokens of left context re-decoded so merges at the boundary come out right

    def __init__(self, codec: Codec, stop: Sequence[str] = ()):
        self.codec, self.stop = codec, tuple(stop)
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were decoded to produce text already accounted
        self._read = 0
        self.text = ""  # all decoded text so far (stop string not cut yet)
        self._shown = 0  # characters of ``text`` already returned
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prev = self.codec.decode(self.ids[self._prefix:self._read])
        cur = self.codec.decode(self.ids[self._prefix:])
        if cur.endswith("\ufffd") or len(cur) < len(prev):
            return ""  # an incomplete multi-byte character: wait for the next token
        self.text += cur[len(prev):]
        self._read = len(self.ids)
        self._prefix = max(self._prefix, self._read - self._WINDOW)
        return self._emit(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        tail = self.codec.decode(self.ids[self._prefix:])
        prev = self.codec.decode(self.ids[self._prefix:self._read])
        if len(tail) > len(prev):  # flush a trailing partial character as the tokenizer renders it
            self.text += tail[len(prev):]
            self._read = len(self.ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        # Text before ``_shown`` was searched already with every stop string's worth of look-ahead
        # held back, so a stop string can only start at ``_shown`` or later.
        hits = [at for at in (self.text.find(s, self._shown) for s in self.stop) if at >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[:min(hits)]
            out = self.text[self._shown:]
            self._shown = len(self.text)
            return out
        end = len(self.text) if final else max(self._shown, len(self.text) - self._hold)
        out = self.text[self._shown:end]
        self._shown = end
        return out
