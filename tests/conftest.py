import sys
from pathlib import Path

import pytest
import transformers

sys.path.insert(0, str(Path(__file__).parent))
transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Tests never touch the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
