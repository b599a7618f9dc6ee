import pytest
import torch

from rollout_helpers import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(123)
    lens = [5, 1, 9, 3, 12]
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: thread wake-ups dominate, and on a loaded 2-core machine an OpenMP barrier
    can cost milliseconds per op. One thread keeps these tests fast and stable."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
