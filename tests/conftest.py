import sys
from pathlib import Path

# tests import their helpers (signals.py) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def asr():
    """The cached tiny random checkpoint (fp32, CPU), torch on one thread: the test machine is
    shared, and one thread is several times faster here. Modules that need another model (a
    talkative one, a fresh random one) define their own `asr`."""
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load("tiny")
