"""cli.py, what the entry points share: device and dtype choice, input checks, the default model, and run_cli's
exit statuses (one `error:` line for bad input, 130 for Ctrl-C)."""
import os

import pytest
import torch

import cli


def test_pick_device():
    assert cli.pick_device("cpu") == torch.device("cpu")
    assert cli.pick_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        cli.pick_device("tpu")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        cli.pick_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:1' requested but CUDA is not available"):
            cli.pick_device("cuda:1")


def test_pick_dtype():
    cpu = torch.device("cpu")
    assert cli.pick_dtype("float16", cpu) == (torch.float16, "--dtype")
    assert cli.pick_dtype("float32", torch.device("cuda")) == (torch.float32, "--dtype")
    assert cli.pick_dtype("auto", torch.device("cuda")) == (torch.bfloat16, "auto: CUDA computes bf16")
    # auto on CPU: bfloat16 only where the CPU computes it natively, and the reason says which instructions
    dtype, why = cli.pick_dtype("auto", cpu)
    native = cli.native_bf16(cpu)
    assert (dtype, why) == ((torch.bfloat16, f"auto: {native} computes bf16") if native else
                            (torch.float32, "auto: no native bf16"))
    # torch's dispatch decides too: with its AVX2 (or scalar) kernels bf16 is emulated, whatever CPUID says
    for capability in ("AVX2", "DEFAULT"):
        assert cli.native_bf16(cpu, capability) is None
        assert cli.pick_dtype("auto", cpu, capability) == (torch.float32, "auto: no native bf16")
    instructions = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()  # CPUID
    assert (cli.native_bf16(cpu, "AVX512") is not None) == instructions
    assert set(cli.DTYPES) == {"float32", "bfloat16", "float16"}


def test_check_text_and_seed():
    cli.check_text("--prompt", "naïve café 日本語")
    cli.check_text("--system", None)
    with pytest.raises(ValueError, match="--prompt is not valid UTF-8 text \\(a bad byte at character 3\\)"):
        cli.check_text("--prompt", "caf\udce9")
    for seed in (None, -2**63, 0, 2**64 - 1):
        cli.check_seed(seed)
    for seed in (-2**63 - 1, 2**64):
        with pytest.raises(ValueError, match=r"--seed must be in \[-2\*\*63, 2\*\*64\)"):
            cli.check_seed(seed)


def test_default_model_is_the_installed_gguf(smollm2_gguf):
    assert cli.default_model() == smollm2_gguf and os.path.isfile(cli.default_model())
    assert cli.FALLBACK_MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_run_cli_exit_statuses(capsys):
    def command(exc):
        def run(args):
            print("out")
            if exc is not None:
                raise exc
        return run

    assert cli.run_cli(command(None), None) == 0
    assert capsys.readouterr() == ("out\n", "")
    for exc in (ValueError("bad value"), FileNotFoundError("no such file")):
        assert cli.run_cli(command(exc), None) == 1
        assert capsys.readouterr().err == f"error: {exc}\n"
    assert cli.run_cli(command(KeyboardInterrupt()), None) == 130
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is a bug: its traceback is wanted
        cli.run_cli(command(RuntimeError("a bug")), None)


def test_version_and_threads(monkeypatch):
    assert cli.version_line() == f"tinyllm {cli.VERSION} (torch {torch.__version__})"
    assert cli.VERSION.count(".") == 2
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # the tests' own thread count stays as it is
    cli.set_threads(None)
    cli.set_threads(4)
    assert calls == [4]
    for n, shown in ((0, "0"), (-2, "-2"), (10**30, "1e+30")):
        with pytest.raises(ValueError) as e:
            cli.set_threads(n)
        assert str(e.value) == f"--threads must be >= 1 and <= 1024, got {shown}"


def test_text_from_a_file_or_stdin(monkeypatch, tmp_path):
    import io

    path = tmp_path / "p.txt"
    path.write_text("naïve\n")
    assert cli.read_text_file(str(path), "prompt file") == "naïve\n"
    with pytest.raises(FileNotFoundError, match="prompt file '.*nope.txt' does not exist"):
        cli.read_text_file(str(tmp_path / "nope.txt"), "prompt file")
    with pytest.raises(ValueError, match="is a directory; expected a text file"):
        cli.read_text_file(str(tmp_path), "prompt file")
    path.write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"prompt file '.*' is not UTF-8 text \(unexpected end of data at byte 3\)"):
        cli.read_text_file(str(path), "prompt file")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stdin, piped in ((io.StringIO("hi"), True), (Terminal(), False), (None, False)):
        monkeypatch.setattr("sys.stdin", stdin)
        assert cli.stdin_piped() == piped
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntwo\n"))
    assert cli.read_stdin() == "one\ntwo\n"
    monkeypatch.setattr("sys.stdin", None)
    with pytest.raises(ValueError, match="stdin, which is closed"):
        cli.read_stdin()


def test_device_flags():
    """add_device_flags: the four flags every model-loading command takes, their defaults, and --dtype's choices."""
    import argparse

    p = argparse.ArgumentParser()
    add = p.add_argument_group("runtime")
    cli.add_device_flags(add)
    args = p.parse_args([])
    assert (args.device, args.dtype, args.threads, args.weights_cache) == (None, "auto", None, None)
    args = p.parse_args(["--device", "cpu", "--dtype", "float16", "--threads", "2", "--weights-cache", "none"])
    assert (args.device, args.dtype, args.threads, args.weights_cache) == ("cpu", "float16", 2, "none")
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "float8"])
