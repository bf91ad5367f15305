"""Tiny random-weight checkpoints in the Hugging Face layout, for tests and demos.

``make_model(out_dir, arch="llama", ...)`` writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (via transformers' ``save_pretrained``) and a byte-level tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``) that needs no download: token id ``b`` is byte
``b`` for ``b < 256``, then ``<bos>``, ``<eos>``, ``<pad>``. Text round-trips exactly through
``AutoTokenizer.from_pretrained(out_dir)`` (encode with ``add_special_tokens=False``).

``make_model(..., random_weights=True)`` writes the same folder without the weights: a
``random_weights.json`` recipe that each worker draws its stage from on its device
(``random_weights``), so a real shape (Llama-2-7B's) is served without a 13 GB file.
``random_stage`` (from ``random_weights``) makes such a stage directly, for benchmarks.

Nothing here is loaded at serving time except through the files it writes.
"""

from __future__ import annotations

import os
from pathlib import Path

from hetserve.runtime.model.random_weights import random_stage, write_marker

__all__ = ["make_model", "random_stage", "save_byte_tokenizer", "bytes_to_unicode", "default_ffn", "check_shape",
           "ShapeError"]

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
ARCHS = ("llama", "opt")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (what the ByteLevel pre-tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def save_byte_tokenizer(out_dir: str | Path, model_max_length: int = 1024) -> None:
    """Write a byte-level tokenizer (ids 0..255 = bytes, 256 <bos>, 257 <eos>, 258 <pad>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", model_max_length=model_max_length)
    fast.save_pretrained(str(out_dir))


def default_ffn(arch: str, hidden: int) -> int:
    """The FFN width ``make_model`` gives ``arch`` when none is asked for."""
    return -(-2 * hidden // 8) * 8 if arch == "llama" else 4 * hidden


class ShapeError(ValueError):
    """A shape ``make_model`` refuses, with the arguments its rule is about, so a caller can name
    them as its user gave them: ``fields`` ``(multiple, divisor)`` for a rule that one divide the
    other, else one field and ``expected``, what it must be."""

    def __init__(self, message: str, fields: tuple[str, ...], expected: str = ""):
        super().__init__(message)
        self.fields, self.expected = fields, expected


def check_shape(arch: str, hidden: int, heads: int, kv_heads: int | None, vocab: int) -> None:
    """The shapes ``make_model`` builds (``ShapeError`` otherwise); ``kv_heads`` None is ``heads``."""
    if arch not in ARCHS:
        raise ShapeError(f"arch must be one of {ARCHS}, got {arch!r}", ("arch",), f"one of {', '.join(ARCHS)}")
    if vocab < 259:
        raise ShapeError(f"vocab must be >= 259 (256 bytes + <bos> <eos> <pad>), got {vocab}", ("vocab",),
                         "at least 259 (256 bytes + <bos> <eos> <pad>)")
    if hidden % heads:
        raise ShapeError(f"hidden ({hidden}) must be a multiple of heads ({heads})", ("hidden", "heads"))
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ShapeError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})", ("heads", "kv_heads"))
    if arch == "opt" and kv_heads != heads:
        raise ShapeError("OPT has no grouped-query attention: leave kv_heads unset", ("kv_heads",),
                         "as many as the heads, or none given (OPT has no grouped-query attention)")


def make_model(out_dir: str | Path, arch: str = "llama", *, layers: int = 4, hidden: int = 64,
               heads: int = 4, kv_heads: int | None = None, ffn: int | None = None, vocab: int = 320,
               max_positions: int = 1024, seed: int = 0, init_std: float = 0.02,
               random_weights: bool = False, dtype: str | None = None) -> Path:
    """Write a random-weight ``arch`` checkpoint with a byte tokenizer to ``out_dir``
    (``random_weights``: the config, the tokenizer and the recipe, no weights file). ``dtype``
    (float32, float16, bfloat16) is the weights' and is named in config.json; None: float32, named
    where weights are saved (transformers records theirs), unnamed in a ``random_weights`` folder.

    ``kv_heads`` (Llama only; GQA when smaller than ``heads``) defaults to ``heads``; ``ffn`` to
    ``4 * hidden`` (OPT) or ``2 * hidden`` rounded up to 8 (Llama). ``vocab`` must be at least 259
    (256 bytes + three special tokens). The same ``seed`` gives the same weights.
    """
    check_shape(arch, hidden, heads, kv_heads, vocab)
    kv_heads = heads if kv_heads is None else kv_heads
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    if arch == "llama":
        ffn = ffn or default_ffn(arch, hidden)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                             initializer_range=init_std, **special)
        cls = LlamaForCausalLM
    else:
        ffn = ffn or default_ffn(arch, hidden)
        config = OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, max_position_embeddings=max_positions,
                           word_embed_proj_dim=hidden, init_std=init_std, dropout=0.0, **special)
        cls = OPTForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if dtype is not None:
        config.dtype = dtype
    if random_weights:
        from transformers import GenerationConfig

        config.save_pretrained(str(out))
        GenerationConfig.from_model_config(config).save_pretrained(str(out))
        write_marker(out, seed, init_std)
    else:
        torch.manual_seed(seed)
        cls(config).to(getattr(torch, dtype or "float32")).eval().save_pretrained(str(out))
    save_byte_tokenizer(out, model_max_length=max_positions)
    _umask_modes(out)
    return out


def _umask_modes(folder: Path) -> None:
    """Give every file written the mode a plain ``open`` gives (0666 less the umask): the weights
    file comes out of transformers' save as 0600 while its siblings follow the umask, and a reader
    who may read the config (a worker under another user, a shared folder) must read the weights too."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)
