"""Without a GPU, Triton kernels run on CPU tensors through the interpreter.

The variable must be set before triton decorates the kernels, so before profuse.kernels.tail is
imported: conftest runs first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE
