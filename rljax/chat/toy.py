"""Toy byte-level tokenizers for examples, doctests and notebooks (no downloads).

``toy_tokenizer(family)`` builds, in microseconds, a byte-level BPE tokenizer with no merges
(ids 0..255 are the bytes, so any text round-trips) plus the added tokens of a chat format
family, wrapped as a Hugging Face ``PreTrainedTokenizerFast``. It is meant for showing the
renderers' behaviour, not for models: real runs load the model's own tokenizer.

>>> tok = toy_tokenizer("chatml")
>>> tok.encode("hi<|im_end|>", add_special_tokens=False)
[104, 105, 258]
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["TOY_TEMPLATES", "toy_tokenizer"]

_FAMILIES: dict[str, dict[str, Any]] = {
    "chatml": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": [
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ],
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "bos": None,
    },
    "llama3": {
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        "added": [],
        "eos": "<|eot_id|>",
        "pad": "<|end_of_text|>",
        "bos": "<|begin_of_text|>",
    },
}

#: Minimal reference templates (plain formats, no tools) for
#: :class:`~rljax.chat.generic.GenericRenderer` examples.
TOY_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.lru_cache(maxsize=8)
def _backend(family: str) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    spec = _FAMILIES[family]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    return tok


def toy_tokenizer(family: str, *, chat_template: str | None = None) -> Any:
    """A byte-level toy tokenizer for ``family`` in {"chatml", "llama3"}.

    Args:
      family: which special tokens to add.
      chat_template: a Jinja chat template, or a key of :data:`TOY_TEMPLATES`.
    """
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {sorted(_FAMILIES)}, got {family!r}")
    from transformers import PreTrainedTokenizerFast

    spec = _FAMILIES[family]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_backend(family).__class__.from_str(_backend(family).to_str()),
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        bos_token=spec["bos"],
    )
    if chat_template is not None:
        tokenizer.chat_template = TOY_TEMPLATES.get(chat_template, chat_template)
    return tokenizer
