import pytest

from turborlhf.data.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tok():
    return make_tiny_tokenizer()
