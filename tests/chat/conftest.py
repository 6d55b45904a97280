"""Session fixtures for the chat tests: tokenizers are trained once per session."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import chat_fixtures  # noqa: E402


@pytest.fixture(scope="session")
def toks():
    """Test tokenizers keyed by template name (see chat_fixtures.build_tokenizers)."""
    return chat_fixtures.build_tokenizers()
