"""Test-wide settings."""

import warnings

import pytest
import torch

# The tests run tiny tensors: one thread avoids oversubscribing the shared cores and is faster.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet():
    """torch.export and transformers warn about their own internals on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
