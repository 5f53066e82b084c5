"""Every numeric flag of every entry point, fed 0, -1 and a huge value: a value its range allows, or exit 1 with one
`error:` line naming the flag, before any work; never a traceback. And the output paths and devices the scripts
check up front."""
import argparse
import importlib

import pytest

import cli
from cli import Range, check_output_file, check_ranges

# entry point -> the flags it needs besides the one under test (none of them loads anything before the check)
ENTRY_POINTS = {"scripts.bench": [], "scripts.export": ["--mode", "int4", "--out", "unused-out"],
                "scripts.quality": [], "scripts.loadtest": ["--concurrency", "1"], "scripts.streaming": [],
                "scripts.servebench": []}
VALUES = (0, -1, 10**30)


def numeric_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.type in (int, float)]


def option(parser: argparse.ArgumentParser, dest: str, last: bool = False) -> str:
    """The flag a user types for `dest`: its first option string (or last: the long one of generate.py's -n)."""
    strings = next(a.option_strings for a in parser._actions if a.dest == dest)
    return strings[-1] if last else strings[0]


def cases() -> list[tuple[str, str, int]]:
    return [(name, action.dest, v) for name in ENTRY_POINTS
            for action in numeric_flags(importlib.import_module(name).build_parser()) for v in VALUES]


def test_every_numeric_flag_has_a_range():
    """A new numeric flag without a declared range fails here, so the table below covers it."""
    for name in ENTRY_POINTS:
        module = importlib.import_module(name)
        dests = {a.dest for a in numeric_flags(module.build_parser())}
        assert dests and dests == set(module.RANGES), f"{name}: {sorted(dests ^ set(module.RANGES))}"
    assert len(cases()) >= 3 * 25  # bench 10, export 3, quality 4, loadtest 9, streaming 5 numeric flags


@pytest.mark.parametrize("name,dest,value", cases())
def test_numeric_flag_table(name, dest, value, capsys, tmp_path, monkeypatch):
    module = importlib.import_module(name)
    if module.RANGES[dest].holds(value):
        return  # an allowed value: a meaningful run, which this table does not start
    monkeypatch.chdir(tmp_path)
    flag = option(module.build_parser(), dest)
    assert module.main([*ENTRY_POINTS[name], flag, str(value)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} must be "), err
    assert "Traceback" not in err and not list(tmp_path.iterdir())  # nothing was written


def test_range_bounds_and_messages():
    r = Range(1, 1024)
    assert [r.holds(v) for v in (0, 1, 1024, 1025, float("nan"))] == [False, True, True, False, False]
    assert str(r) == ">= 1 and <= 1024" and str(Range(0, above=True)) == "> 0"
    assert not Range(0, above=True).holds(0) and Range(0, above=True).holds(1e-9)
    args = argparse.Namespace(batch_size=[1, 0], threads=None)
    with pytest.raises(ValueError, match=r"^--batch-size must be >= 1 and <= 8, got 0$"):
        check_ranges(args, {"batch_size": Range(1, 8), "threads": Range(1, 8)})
    check_ranges(argparse.Namespace(threads=None), {"threads": Range(1, 8)})  # unset passes


@pytest.mark.parametrize("argv,message", [
    (["--threads", "-1"], "--threads must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--plan", "--shape", "smollm2-135m", "--memory-gib", "-1"], "--memory-gib must be > 0"),
    (["--plan", "--shape", "smollm2-135m", "--bandwidth-gbs", "0"], "--bandwidth-gbs must be > 0"),
    (["--plan", "--shape", "smollm2-135m", "--context", "0"], "--context must be >= 1"),
    (["--plan", "--shape", "smollm2-135m", "--kv-bytes", "0"], "--kv-bytes must be > 0"),
    (["--batch-size", "1", "0"], "--batch-size must be >= 1"),
    (["--json", "."], "--json '.' is a directory"),
    (["--json", "no/such/folder/out.json"], "does not exist"),
])
def test_bench_refuses_before_it_runs(argv, message, capsys, tmp_path, monkeypatch):
    from scripts import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "model_under_test", lambda *a: pytest.fail("the benchmark ran"))
    assert bench.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_check_output_file(tmp_path):
    check_output_file(None, "--json")
    check_output_file(str(tmp_path / "new.json"), "--json")
    with pytest.raises(ValueError, match="is a directory"):
        check_output_file(str(tmp_path), "--json")
    with pytest.raises(ValueError, match="does not exist"):
        check_output_file(str(tmp_path / "no" / "x.json"), "--out")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if not os.access(locked, os.W_OK):  # root writes anywhere: then there is nothing to refuse
            with pytest.raises(ValueError, match="not writable"):
                check_output_file(str(locked / "x.json"), "--json")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("name", ["scripts.loadtest", "scripts.streaming"])
def test_json_directory_is_refused_first(name, capsys, tmp_path):
    module = importlib.import_module(name)
    assert module.main([*ENTRY_POINTS[name], "--json", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err, err


def test_quality_names_a_device_it_lacks(capsys, monkeypatch):
    from scripts import quality

    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(quality, "evaluate", lambda *a, **k: pytest.fail("it evaluated"))
    assert quality.main(["--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err == "error: device 'cuda' requested but CUDA is not available\n", err


# generate.py's numeric flags run for real on a tiny model: a value either runs or is one error line.
GENERATE_COMPANIONS = {"sink_tokens": ["--cache-window", "16"], "speculate_k": ["--prompt-lookup"]}


def generate_cases() -> list[tuple[str, int]]:
    import generate

    return [(a.dest, v) for a in numeric_flags(generate.build_parser()) for v in VALUES]


@pytest.mark.parametrize("dest,value", generate_cases())
def test_generate_numeric_flag_table(dest, value, capsys, tiny_text_dir):
    import generate

    flag = option(generate.build_parser(), dest, last=True)
    argv = ["--model", tiny_text_dir, "--prompt", "hi", "-n", "2", "--quiet", *GENERATE_COMPANIONS.get(dest, []),
            flag, str(value)]
    code = generate.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    if code == 1:
        assert err.count("\n") == 1 and err.startswith("error: "), err
    else:
        assert code == 0 and "error" not in err, (code, err)  # --quiet: only what a flag adds (--logprobs' table)


def serve_cases() -> list[tuple[str, int]]:
    import serve

    return [(a.dest, v) for a in serve.build_parser()._actions if a.dest in serve.RANGES for v in VALUES]


def test_every_serve_numeric_flag_has_a_range():
    import serve

    numeric = {a.dest for a in numeric_flags(serve.build_parser())} | {"num_blocks", "wide_rows"}  # N or a word
    assert numeric == set(serve.RANGES), sorted(numeric ^ set(serve.RANGES))


@pytest.mark.parametrize("dest,value", serve_cases())
def test_serve_numeric_flag_table(dest, value):
    """serve.py's flags are checked before the model loads (check_flags): a value out of its range is one
    ValueError naming the flag; one in it is what a server may start with (not started here)."""
    import serve

    flag = option(serve.build_parser(), dest)
    companions = ["--cache-window", "16"] if dest == "sink_tokens" else []
    args = serve.parse_args([*companions, flag, str(value)])
    if serve.RANGES[dest].holds(value):
        serve.check_flags(args)
        return
    with pytest.raises(ValueError) as e:
        serve.check_flags(args)
    assert str(e.value).startswith(f"{flag} must be ") and "\n" not in str(e.value)


def test_llama_cpp_aliases_share_the_checked_flags_and_the_documented_exceptions():
    """llama.cpp's and vLLM's names (-c, -t, --ctx-size, --repeat-penalty) are the checked flags under another
    name, not new unchecked ones; the exceptions to ">= 1" are llama.cpp's: -n -1 (until the end of turn or a full
    context) and -c 0 (the model's context), for generate.py and serve.py alike."""
    import generate
    import serve

    for parser, dests in ((generate.build_parser(), {"-c": "ctx_size", "--ctx-size": "ctx_size", "-t": "threads",
                                                     "--repeat-penalty": "repetition_penalty"}),
                          (serve.build_parser(), {"-c": "max_model_len", "--ctx-size": "max_model_len",
                                                  "-t": "threads"})):
        for flag, dest in dests.items():
            assert parser._option_string_actions[flag].dest == dest and parser._option_string_actions[flag].type in \
                (int, float)
    for argv, allowed in ((["-n", "-1"], True), (["-n", "-2"], False), (["-n", "0"], False), (["-c", "0"], True),
                          (["-c", "1"], False), (["-c", "-1"], False)):
        args = generate.parse_args(["-p", "hi", *argv])
        if allowed:
            generate.check_args(args)
        else:
            with pytest.raises(ValueError, match=r"^--(max-new-tokens|ctx-size) must be "):
                generate.check_args(args)
    serve.check_flags(serve.parse_args(["-c", "0"]))
    with pytest.raises(ValueError, match=r"^--max-model-len must be >= 0"):
        serve.check_flags(serve.parse_args(["--ctx-size", "-1"]))
