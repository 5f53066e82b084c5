"""The fast subset's guard (conftest.py) can fail: in a pytest run of its own, over this conftest, a test not marked
slow that calls torch.compile, starts a subprocess or a multiprocessing process, or asks for a SmolLM2 model fixture
fails naming what it did; marked slow, the same test is left alone."""
import os

import pytest

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")

CASES = {
    "compile": ("import torch\n    torch.compile(lambda x: x)", "calls torch.compile"),
    "subprocess": ("import subprocess, sys\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)",
                   "starts a subprocess (subprocess.Popen)"),
    "multiprocessing": ("import multiprocessing\n    p = multiprocessing.get_context('spawn').Process(target=print)"
                        "\n    p.start(); p.join()", "starts a process (multiprocessing)"),
    "fixture": ("request.getfixturevalue('smollm2_int4_dir')", "uses the SmolLM2 fixture smollm2_int4_dir"),
}


@pytest.mark.slow  # the cases marked slow really start processes
@pytest.mark.parametrize("case", list(CASES))
def test_the_fast_subset_guard_fails_what_it_names(pytester, case):
    body, what = CASES[case]
    pytester.makeconftest(open(CONFTEST).read())
    slow = "" if case == "fixture" else f"\n\n@pytest.mark.slow\ndef test_slow(request):\n    {body}\n"  # no export
    pytester.makepyfile(f"import pytest\n\ndef test_fast(request):\n    {body}\n{slow}")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=0 if case == "fixture" else 1)
    result.stdout.fnmatch_lines([f"*::test_fast is not marked slow but {what}*mark it @pytest.mark.slow*"])
