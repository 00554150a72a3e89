import pytest

from jaxppo.data import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)
