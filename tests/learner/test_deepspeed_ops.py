"""The DeepSpeed op the CPU learner loads is built per Python environment (learner/deepspeed_ops.py):
two checkouts on one machine do not rebuild it in turn."""

import os
import sys
from pathlib import Path

from learner.deepspeed_ops import use_own_extension_dir


def test_the_extensions_live_in_this_environment(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    use_own_extension_dir()
    if os.access(sys.prefix, os.W_OK):
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    else:  # torch's own default (~/.cache/torch_extensions)
        assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_a_directory_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    use_own_extension_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)
