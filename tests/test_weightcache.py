"""The weights cache (weightcache.py): a GGUF load read back from its entry equals the load that converted the file,
tensor for tensor and layout for layout; a changed file, another dtype or request is another entry; a broken entry is
converted again; entries are pruned; generate.py prints the same text with a cold and a warm cache."""
import os

import pytest
import torch
import torch.nn as nn

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import load
from formats import weightcache
from helpers import run_py
from quantize import Int4Linear
from tiny_models import make_hf_llama, write_llama_gguf


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(), *model.named_buffers()])


def layouts(model: nn.Module) -> dict[str, str | None]:
    return {name: m.kernel for name, m in model.named_modules() if isinstance(m, Int4Linear)}


def entries(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(weightcache.SUFFIX))


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        bits = [t.contiguous().flatten().view(torch.uint8) for t in (sa[name], sb[name])]  # the words' too (gemv.py)
        assert sa[name].dtype == sb[name].dtype and torch.equal(*bits), name
    assert layouts(a) == layouts(b)
    tokens = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a(tokens, torch.arange(12), all_logits=True), b(tokens, torch.arange(12), all_logits=True))


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    """A tiny llama GGUF with Q4_1 block linears and a Q8_0 head: every route a load converts."""
    path = tmp_path_factory.mktemp("weightcache") / "tiny.gguf"
    return write_llama_gguf(path, make_hf_llama(tied=False), "Q4_1", {"output": "Q8_0"})


def no_conversion(monkeypatch):
    """Make any tensor-by-tensor conversion fail: what loads after this came from the cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("converted a tensor although the cache holds the load")
    monkeypatch.setattr(load.GGUFRoutes, "put", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hit_equals_the_conversion(q4_file, tmp_path, monkeypatch, dtype):
    converted, _ = load.load_model(q4_file, "cpu", dtype, cache_dir=str(tmp_path))
    assert len(entries(tmp_path)) == 1
    assert converted.layers[0].mlp.down_proj.kernel == "cpu"
    no_conversion(monkeypatch)
    restored, _ = load.load_model(q4_file, "cpu", dtype, cache_dir=str(tmp_path))
    assert_same_model(restored, converted)


def test_a_hit_restores_a_q8_0_heads_words_on_avx2(q4_file, tmp_path, monkeypatch):
    """Where torch dispatches AVX2 the Q8_0 head also has its words (gemv.py), which the entry holds too."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    converted, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=str(tmp_path))
    assert converted.lm_head.words is not None
    no_conversion(monkeypatch)
    restored, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=str(tmp_path))
    assert restored.lm_head.words is not None
    assert_same_model(restored, converted)


def test_without_a_cache_nothing_is_written_and_the_load_is_the_same(q4_file, tmp_path):
    plain, _ = load.load_model(q4_file, "cpu", torch.float32)
    cached, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=str(tmp_path))
    again, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=str(tmp_path))
    assert_same_model(plain, cached)
    assert_same_model(plain, again)


def test_a_tied_float_head_stays_tied(tmp_path):
    path = write_llama_gguf(tmp_path / "tied.gguf", make_hf_llama(tied=True), "Q4_0")
    load.load_model(path, "cpu", torch.float32, cache_dir=str(tmp_path / "cache"))
    restored, _ = load.load_model(path, "cpu", torch.float32, cache_dir=str(tmp_path / "cache"))
    assert isinstance(restored.lm_head, nn.Linear) and restored.lm_head.weight is restored.embed_tokens.weight


def test_the_key_covers_file_dtype_and_request(q4_file, tmp_path):
    """Each of another dtype and another request is an entry of its own (KEEP per file, the newest); a file that
    changed is a miss whose entry replaces the stale one."""
    cache = str(tmp_path / "cache")
    load.load_model(q4_file, "cpu", torch.float32, cache_dir=cache)
    load.load_model(q4_file, "cpu", torch.bfloat16, cache_dir=cache)
    assert len(entries(cache)) == 2
    load.load_model(q4_file, "cpu", torch.float32, quantize="int8", cache_dir=cache)
    assert len(entries(cache)) == weightcache.KEEP == 2
    int8, _ = load.load_model(q4_file, "cpu", torch.float32, quantize="int8", cache_dir=cache)
    assert type(int8.layers[0].mlp.down_proj).__name__ == "Int8Linear"

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(open(q4_file, "rb").read())
    load.load_model(str(copy), "cpu", torch.float32, cache_dir=cache)
    before = set(entries(cache))
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # the file changed (as far as a key can tell)
    load.load_model(str(copy), "cpu", torch.float32, cache_dir=cache)
    after = set(entries(cache))
    assert len(after) == len(before) and after != before  # the stale entry pruned, the new one written
    copy.unlink()
    load.load_model(q4_file, "cpu", torch.float32, cache_dir=cache)  # a store prunes the entries of a removed file
    assert len(entries(cache)) == 2


def test_a_broken_entry_is_converted_again(q4_file, tmp_path, capsys):
    cache = str(tmp_path)
    want, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=cache)
    (entry,) = entries(cache)
    with open(os.path.join(cache, entry), "r+b") as f:  # truncated, as a full disk or a killed writer leaves it
        f.truncate(os.path.getsize(os.path.join(cache, entry)) // 2)
    got, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=cache)
    assert "unreadable" in capsys.readouterr().err
    assert_same_model(got, want)
    assert os.path.getsize(os.path.join(cache, entry)) > 0 and entries(cache) == [entry]  # written again


def test_an_entry_that_does_not_fit_the_structure_is_a_miss(q4_file, tmp_path):
    """An entry naming a tensor the model has no place for (written by other code, say) fills nothing."""
    cache = str(tmp_path)
    want, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=cache)
    (entry,) = entries(cache)
    with safe_open(os.path.join(cache, entry), "pt") as f:
        meta = f.metadata()
    tensors = load_file(os.path.join(cache, entry))
    tensors["layers.0.extra"] = torch.zeros(1)
    save_file({k: v.clone() for k, v in tensors.items()}, os.path.join(cache, entry), metadata=meta)
    got, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=cache)
    assert_same_model(got, want)


def test_an_unwritable_cache_is_a_warning(q4_file, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=str(blocker / "cache"))
    assert "could not write the weights cache" in capsys.readouterr().err
    assert model.layers[0].mlp.down_proj.kernel == "cpu"


def test_a_failed_write_is_a_warning(q4_file, tmp_path, monkeypatch, capsys):
    """safetensors raises its own error type for an I/O error while writing (a full disk): a warning too, and no
    temporary file is left."""
    def full_disk(tensors, path, metadata=None):
        open(path, "wb").close()
        raise SafetensorError("Error while serializing: I/O error: No space left on device")
    monkeypatch.setattr(weightcache, "save_file", full_disk)
    model, _ = load.load_model(q4_file, "cpu", torch.float32, cache_dir=str(tmp_path))
    assert "could not write the weights cache" in capsys.readouterr().err
    assert os.listdir(tmp_path) == [] and model.layers[0].mlp.down_proj.kernel == "cpu"


@pytest.mark.slow
def test_generate_prints_the_same_text_cold_and_warm(smollm2_gguf, tmp_path):
    """The README's first command, with its cache cold, warm, and off."""
    args = ("generate.py", "--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens", "12")
    cold = run_py(*args, "--weights-cache", str(tmp_path))
    assert cold.returncode == 0, cold.stderr
    assert len(entries(tmp_path)) == 1
    warm = run_py(*args, "--weights-cache", str(tmp_path))
    off = run_py(*args, "--weights-cache", "none")
    assert warm.returncode == 0 and off.returncode == 0, warm.stderr + off.stderr
    assert cold.stdout == warm.stdout == off.stdout and cold.stdout.strip()
