"""Renderers by name, for configs (``config.renderer = "qwen3"``).

>>> from rljax.chat.toy import toy_tokenizer
>>> type(make_renderer("chatml", toy_tokenizer("chatml"))).__name__
'ChatMLRenderer'
"""

from __future__ import annotations

from typing import Any

from rljax.chat.base import Renderer
from rljax.chat.chatml import ChatMLRenderer, Qwen25Renderer, SmolLM2Renderer
from rljax.chat.generic import GenericRenderer
from rljax.chat.llama3 import Llama3Renderer
from rljax.chat.qwen3 import Qwen3Renderer

__all__ = ["RENDERERS", "make_renderer"]

#: The built-in renderers by name (``config.renderer.name``; :func:`make_renderer`).
RENDERERS: dict[str, type[Renderer]] = {
    "generic": GenericRenderer,
    "chatml": ChatMLRenderer,
    "qwen2.5": Qwen25Renderer,
    "qwen3": Qwen3Renderer,
    "llama3": Llama3Renderer,
    "smollm2": SmolLM2Renderer,
}


def make_renderer(name: str, tokenizer: Any, **kwargs: Any) -> Renderer:
    """Builds the renderer ``name`` for ``tokenizer``: a key of :data:`RENDERERS`, or the import
    string ``"module:attr"`` of your own :class:`~rljax.chat.base.Renderer` subclass (or a factory
    returning one), called as ``attr(tokenizer, **kwargs)``.

    >>> from rljax.chat.toy import toy_tokenizer
    >>> r = make_renderer("rljax.chat.chatml:ChatMLRenderer", toy_tokenizer("chatml"))
    >>> type(r).__name__
    'ChatMLRenderer'
    """
    if ":" in name:
        from rljax.envs.loader import load_attr  # the resolver of every "module:attr" name

        made = load_attr(name)(tokenizer, **kwargs)
        if not isinstance(made, Renderer):
            raise ValueError(f"renderer {name!r} built {type(made).__name__}, not an rljax.chat.Renderer")
        return made
    if name not in RENDERERS:
        raise ValueError(
            f"unknown renderer {name!r}; choose one of {sorted(RENDERERS)}, or 'module:attr' of your own"
        )
    return RENDERERS[name](tokenizer, **kwargs)
