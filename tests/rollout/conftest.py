"""Fixtures of the engine tests: the tiny tokenizer and a random tiny Llama (covey/models/tiny.py), one of
each per test module."""

import pytest

from covey.models.tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def llama(tok):
    """On the CPU, in eval mode."""
    return tiny_llama(len(tok)).eval()
