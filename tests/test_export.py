"""export.py: quantized checkpoint folders (size, metadata, tokenizer, a round trip that is token-identical to
quantizing at load), the config.json written for a GGUF source, and the --out folder checked before loading."""
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scripts import export
from formats.hffolder import read_quantization
from load import load_model
from model import ModelArgs
from quantize import quantization_of
from tiny_models import greedy_ids, hf_to_ours, make_hf
from tokenizer import load_tokenizer


# ---- a tiny model folder (fast) ----

def test_tiny_round_trip_equals_quantizing_at_load(tiny_dir, tmp_path):
    out = tmp_path / "int8"
    assert export.main(["--model", tiny_dir, "--mode", "int8", "--out", str(out), "--dtype", "float32"]) == 0
    # the source folder's files copied beside the weights (this one has no tokenizer)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert read_quantization(str(out / "model.safetensors")) == {
        "quantization": "int8", "group_size": "", "quantize_head": "false"}
    loaded, _ = load_model(str(out), "cpu", torch.float32)
    at_load, _ = load_model(tiny_dir, "cpu", torch.float32, quantize="int8")
    saved_state = loaded.state_dict()
    for name, tensor in at_load.state_dict().items():
        assert torch.equal(saved_state[name], tensor), name
    assert greedy_ids(loaded, [5, 17, 42], 12) == greedy_ids(at_load, [5, 17, 42], 12)
    # writing again into its own previous output is allowed
    assert export.main(["--model", tiny_dir, "--mode", "int4:32", "--out", str(out), "--dtype", "float32"]) == 0
    assert read_quantization(str(out / "model.safetensors"))["quantization"] == "int4"


@pytest.mark.parametrize("name", ["llama-gqa", "llama3-rope", "llama-tied"])
def test_hf_config_round_trips_model_args(name):
    args = hf_to_ours(make_hf(name)).args
    assert ModelArgs.from_hf_config(args.to_hf_config()) == args


def test_hf_config_refuses_what_config_json_cannot_hold():
    args = hf_to_ours(make_hf("llama-gqa")).args
    with pytest.raises(ValueError, match="rope factors"):
        dataclasses.replace(args, rope_freq_factors=(1.0,) * 12).to_hf_config()
    with pytest.raises(ValueError, match="sliding-window"):
        dataclasses.replace(args, sliding_window=16).to_hf_config()


def test_out_folder_is_checked_before_loading(tmp_path, cli_error):
    missing_model = str(tmp_path / "missing.gguf")
    (tmp_path / "file").write_text("mine")
    err = cli_error(export.main, ["--mode", "int8", "--out", str(tmp_path / "file" / "out"), "--model", missing_model])
    assert "is a file, not a folder" in err  # not the missing model: the folder is checked first
    assert (tmp_path / "file").read_text() == "mine"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    err = cli_error(export.main, ["--mode", "int8", "--out", str(tmp_path / "notes"), "--model", missing_model])
    assert "is not empty and is not a previous" in err and "output" in err and "notes.txt" in err
    assert (tmp_path / "notes" / "notes.txt").read_text() == "mine"
    # a folder holding only model.safetensors without quantization metadata is not a previous output either
    (tmp_path / "float").mkdir()
    save_file({"x": torch.zeros(1)}, tmp_path / "float" / "model.safetensors")
    with pytest.raises(ValueError, match="is not empty"):
        export.check_out_folder(str(tmp_path / "float"))
    (tmp_path / "float" / "model.safetensors").write_bytes(b"not safetensors")  # nor is a corrupt one
    with pytest.raises(ValueError, match="is not empty"):
        export.check_out_folder(str(tmp_path / "float"))
    export.check_out_folder(str(tmp_path / "new" / "deeper"))  # a folder that can be created is fine


def test_bad_mode_is_one_error_line(tmp_path, cli_error):
    err = cli_error(export.main, ["--mode", "int3", "--out", str(tmp_path / "out")])
    assert "unknown quantization mode 'int3'" in err
    assert not (tmp_path / "out").exists()


# ---- SmolLM2 from its GGUF ----

@pytest.mark.slow
def test_saved_checkpoint_size_and_metadata(smollm2_int4_dir, smollm2):
    model, _ = smollm2
    bf16_bytes = sum(p.numel() for p in model.parameters()) * 2  # the same model as a bf16 checkpoint
    folder = Path(smollm2_int4_dir)
    folder_bytes = sum(f.stat().st_size for f in folder.iterdir())
    assert folder_bytes < 0.4 * bf16_bytes, (folder_bytes, bf16_bytes)
    assert read_quantization(str(folder / "model.safetensors")) == {
        "quantization": "int4", "group_size": "64", "quantize_head": "true"}
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.slow
def test_saved_tokenizer_matches_gguf(smollm2_int4_dir, smollm2_tokenizer):
    ours, theirs = load_tokenizer(smollm2_int4_dir), smollm2_tokenizer
    for text in ["Hello world", "  two  spaces\nand 12345 digits", "<|im_start|>user\nhi<|im_end|>", "héllo ✓"]:
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert (ours.bos_id, ours.eos_ids, ours.add_bos) == (theirs.bos_id, theirs.eos_ids, theirs.add_bos)


@pytest.mark.slow
def test_saved_checkpoint_round_trip_is_token_identical(smollm2_int4_dir, smollm2_gguf):
    loaded, _ = load_model(smollm2_int4_dir, "cpu", torch.bfloat16)
    at_load, _ = load_model(smollm2_gguf, "cpu", torch.bfloat16, quantize="int4:64", quantize_head=True)
    saved_state = loaded.state_dict()
    for name, tensor in at_load.state_dict().items():
        assert torch.equal(saved_state[name], tensor), name
    tok = load_tokenizer(smollm2_int4_dir)
    prompt = tok.encode("The capital of France is")
    assert greedy_ids(loaded, prompt, 24) == greedy_ids(at_load, prompt, 24)


# ---- --out against the source, and files written whole or not at all ----

def export_int8(model: str, out) -> int:
    return export.main(["--model", model, "--mode", "int8", "--out", str(out), "--dtype", "float32"])


def no_loading(monkeypatch):
    """Loading the model fails the test: the refusal must come before it."""
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was refused")

    monkeypatch.setattr(export, "load_model", load_model)


def test_out_is_the_source_folder(tiny_dir, tmp_path, cli_error, monkeypatch):
    """Its own previous output as the source: refused before loading, the files untouched (they were rewritten
    while memory-mapped as the source)."""
    out = tmp_path / "int8"
    assert export_int8(tiny_dir, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    no_loading(monkeypatch)
    err = cli_error(export.main, ["--model", str(out), "--mode", "int8", "--out", str(out) + "/."])
    assert "is the source model folder" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_out_that_would_overwrite_a_source_file(tiny_dir, tmp_path, cli_error, monkeypatch):
    """A previous output whose config.json is a link to the source's: writing it would rewrite the source's."""
    source, out = tmp_path / "source", tmp_path / "out"
    assert export_int8(tiny_dir, source) == 0
    assert export_int8(tiny_dir, out) == 0
    (out / "config.json").unlink()
    os.link(source / "config.json", out / "config.json")
    no_loading(monkeypatch)
    err = cli_error(export.main, ["--model", str(source), "--mode", "int8", "--out", str(out)])
    assert "writing config.json would overwrite a file of the source model" in err


@pytest.mark.parametrize("out, fragment", [
    ("/proc/tinyllm-export", "cannot be written"),
    ("", "--out is empty"),
])
def test_out_that_cannot_be_written(tmp_path, cli_error, out, fragment):
    if out.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc on this system")
    err = cli_error(export.main, ["--mode", "int8", "--out", out, "--model", str(tmp_path / "missing.gguf")])
    assert fragment in err  # not the missing model: --out is checked first


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_out_without_permission(tmp_path, cli_error):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    err = cli_error(export.main, ["--mode", "int8", "--out", str(locked / "out"),
                                  "--model", str(tmp_path / "missing.gguf")])
    assert "cannot be written" in err and "Permission denied" in err


def test_failed_write_leaves_the_previous_output_whole(tiny_dir, tmp_path, cli_error, monkeypatch):
    """The disk fills while model.safetensors is written: the previous output is as it was, no partial file left."""
    import errno

    import safetensors.torch

    out = tmp_path / "int8"
    assert export_int8(tiny_dir, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(state, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    err = cli_error(export.main, ["--model", tiny_dir, "--mode", "int4:32", "--out", str(out)])
    assert "cannot write to --out" in err and "No space left on device" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_leftovers_of_a_killed_export_and_stale_files(tiny_dir, tmp_path):
    """A killed export's partial files do not make the folder foreign, and are replaced; a previous output's file
    that this export does not write (a chat template that would override the new one) is removed."""
    out = tmp_path / "int8"
    out.mkdir()
    (out / export.partial_name("model.safetensors")).write_bytes(b"killed midway")
    assert export_int8(tiny_dir, out) == 0
    (out / "chat_template.jinja").write_text("{{ messages }}")
    (out / export.partial_name("config.json")).write_text("{")
    assert export_int8(tiny_dir, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded, _ = load_model(str(out), "cpu", torch.float32)
    assert quantization_of(loaded)["quantization"] == "int8"
