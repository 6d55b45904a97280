"""The tokenizer and chat template of a GGUF file, as a fast Hugging Face tokenizer.

A GGUF file carries no ``tokenizer.json``: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``,
by id), the BPE merges, each token's type (normal, control, user-defined, ...), the special token
ids, the ``add_bos_token`` flag, the chat template, and the name of the pre-tokenizer the vocabulary
was trained with (``tokenizer.ggml.pre``: a regular expression that llama.cpp hard-codes per name).
:func:`gguf_tokenizer` rebuilds the tokenizer with the ``tokenizers`` library from exactly these
fields and wraps it in ``transformers.PreTrainedTokenizerFast``, so it is a fast tokenizer with
offsets and ``apply_chat_template`` like any HF tokenizer the renderers take.

It is built here rather than with transformers' own GGUF conversion
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) because that conversion (a) maps only some
``tokenizer.ggml.pre`` names to their split expressions and falls back to GPT-2's for the others,
e.g. SmolLM's, whose vocabulary was trained with every digit split off (``"x  12"`` is
``["x", "ĠĠ", "1", "2"]`` with the digit split and ``["x", "Ġ", "Ġ", "1", "2"]`` without), and (b) has
changed shape across transformers releases, while this module's behaviour is pinned by its tests.

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen2/2.5/3,
SmolLM, GPT-2) with the pre-tokenizers of :data:`PRE_TOKENIZERS`. Other vocabularies
(sentencepiece ``"llama"`` files of Llama 2 and older) and unknown pre-tokenizer names raise a
``ValueError`` naming the field, instead of tokenizing differently from the model's training.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from rljax.models.gguf_io import open_gguf, read_gguf_metadata

__all__ = ["PRE_TOKENIZERS", "build_gguf_tokenizer", "gguf_tokenizer"]

# llama.cpp's token types (llama_token_type): 3 = control (special), 4 = user-defined (added text).
CONTROL, USER_DEFINED = 3, 4

# The split expressions of the pre-tokenizers below, as llama.cpp and the models' own tokenizer.json
# spell them.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(expression: str) -> Callable[[], Any]:
    def build() -> Any:
        from tokenizers import Regex, pre_tokenizers

        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(expression), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


#: ``tokenizer.ggml.pre`` -> (pre-tokenizer builder, ``ignore_merges``: a word that is a whole
#: vocabulary entry is one token without applying merges, as llama.cpp and Llama 3's tokenizer do).
PRE_TOKENIZERS: dict[str, tuple[Callable[[], Any], bool]] = {
    "default": (_gpt2, False),
    "gpt-2": (_gpt2, False),
    "gpt2": (_gpt2, False),
    "smollm": (_smollm, False),
    "qwen2": (_split(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (_split(_QWEN2_SPLIT), False),
    "llama-bpe": (_split(_LLAMA3_SPLIT), True),
    "llama3": (_split(_LLAMA3_SPLIT), True),
    "llama-v3": (_split(_LLAMA3_SPLIT), True),
}


def _token(metadata: Mapping[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return None if token_id is None else tokens[int(token_id)]


def _post_processor(metadata: Mapping[str, Any], tokens: list[str]) -> Any:
    """Byte-level offsets, and the BOS / EOS tokens ``tokenizer(text)`` adds when the file's
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say so (llama.cpp's defaults: neither)."""
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)]
    added = {}
    for key in ("bos", "eos"):
        if metadata.get(f"tokenizer.ggml.add_{key}_token", False):
            token = _token(metadata, tokens, key)
            if token is None:
                raise ValueError(
                    f"GGUF tokenizer.ggml.add_{key}_token is true but the file has no {key}_token_id"
                )
            added[key] = (token, int(metadata[f"tokenizer.ggml.{key}_token_id"]))
    if added:
        bos = f"{added['bos'][0]} " if "bos" in added else ""
        eos = f" {added['eos'][0]}" if "eos" in added else ""
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos}$A{eos}",
                pair=f"{bos}$A{eos} {bos}$B{eos}",
                special_tokens=list(set(added.values())),
            )
        )
    return processors.Sequence(steps)


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> Any:
    """A ``PreTrainedTokenizerFast`` from a GGUF file's metadata (:func:`read_gguf_metadata`).

    Control tokens (``<|im_start|>``, ...) become special added tokens, user-defined ones plain
    added tokens; both keep their ids. ``bos``/``eos``/``unk``/``pad`` come from the
    ``tokenizer.ggml.*_token_id`` fields, the chat template from ``tokenizer.chat_template``; the
    BOS (EOS) token is added by ``tokenizer(text)`` only when ``tokenizer.ggml.add_bos_token``
    (``add_eos_token``) is true.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported; rljax builds byte-level BPE ('gpt2') "
            "vocabularies. Use the model's HF tokenizer directory as config.tokenizer.name instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported; rljax knows {sorted(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated spelling keeps its first id, as llama.cpp's lookup does
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    build_pre, ignore_merges = PRE_TOKENIZERS[pre]
    bpe = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = build_pre()
    backend.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    typed = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in typed if k == USER_DEFINED]
    )
    backend.post_processor = _post_processor(metadata, tokens)
    bos = _token(metadata, tokens, "bos")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=_token(metadata, tokens, "eos"),
        unk_token=_token(metadata, tokens, "unknown"),
        pad_token=_token(metadata, tokens, "padding"),
        clean_up_tokenization_spaces=False,
    )
    template = metadata.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer (with its chat template) of the GGUF file at ``path`` (:func:`build_gguf_tokenizer`)."""
    return build_gguf_tokenizer(read_gguf_metadata(open_gguf(path)))
