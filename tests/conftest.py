"""Test-wide settings."""

import torch

# The tests run tiny tensors: one thread avoids oversubscribing the shared cores and is faster.
torch.set_num_threads(1)
