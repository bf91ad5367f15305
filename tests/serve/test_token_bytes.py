"""A chat logprob's ``bytes`` are its token's own bytes (``Codec.token_bytes``): the pieces of
a character split over tokens join back into it, with byte-level and byte-fallback vocabularies."""

from __future__ import annotations

from hetserve.serve.choices import LogprobWriter
from hetserve.serve.text import HFCodec
from hetserve.runtime.model.make import save_byte_tokenizer

TEXT = "é€😀 a\tb"


def _byte_level(tmp_path) -> HFCodec:
    save_byte_tokenizer(tmp_path)
    return HFCodec.from_dir(tmp_path)


def _byte_fallback(strip_first_space: bool = False) -> HFCodec:
    """A sentencepiece-style vocabulary: ASCII letters, ``▁`` and ``▁a``, every other byte as ``<0xNN>``;
    ``strip_first_space``: its decoder drops the text's first space, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for ch in ["▁a", *"abcdefghijklmnopqrstuvwxyz▁"]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    strip = [decoders.Strip(" ", 1, 0)] if strip_first_space else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return HFCodec(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"))


def test_byte_level_tokens_join_back_into_the_text(tmp_path):
    codec = _byte_level(tmp_path)
    ids = codec.encode(TEXT)
    assert len(ids) == len(TEXT.encode())  # one token a byte: the multi-byte characters are split
    entries = LogprobWriter(codec).chat([(i, -1.0, None) for i in ids])["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == TEXT
    assert any(e["token"] == "\ufffd" for e in entries)  # a piece's text alone, as vLLM shows it
    assert codec.token_bytes(codec.eos_token_id) == b""  # a special token is its (empty) text


def test_byte_fallback_tokens_join_back_into_the_text():
    codec = _byte_fallback()
    ids = codec.encode(TEXT)
    assert codec.decode(ids) == TEXT
    assert b"".join(codec.token_bytes(i) for i in ids).decode() == TEXT


def test_a_sentencepiece_piece_keeps_its_space_though_decoded_alone_it_loses_it():
    """Llama's decoder strips the text's first space, so ``▁a`` decoded alone is ``a``; its bytes are
    `` a``, and a completion's pieces join back into its text with the spaces between words."""
    codec = _byte_fallback(strip_first_space=True)
    ids = codec.encode("b a a")
    pieces = codec.tok.convert_ids_to_tokens(ids)
    assert pieces == ["b", "▁a", "▁a"], pieces
    assert codec.decode([ids[1]]) == "a" and codec.token_bytes(ids[1]) == b" a"
    assert b"".join(codec.token_bytes(i) for i in ids).decode() == codec.decode(ids) == "b a a"

