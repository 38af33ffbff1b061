"""The one `cuda` mark: `@cuda` from runners.testing both marks a test (so `-m cuda` selects it)
and skips it without a GPU; the collection hook skips a plain `@pytest.mark.cuda` too."""
import pytest

from draft_circuit.runners.device import cuda_available
from draft_circuit.runners.testing import cuda

pytest_plugins = ["pytester"]

TESTS = """
import pytest
from draft_circuit.runners.testing import cuda

@cuda
def test_decorated():
    pass

@cuda
class TestGrouped:
    def test_in_class(self):
        pass

@pytest.mark.cuda
def test_plain_mark():
    pass

def test_cpu():
    pass
"""
HOOK = """
from draft_circuit.runners.testing import skip_cuda_without_gpu

def pytest_collection_modifyitems(config, items):
    skip_cuda_without_gpu(items)
"""


def run_marked(pytester, *, hook: bool):
    pytester.makeini("[pytest]\nmarkers =\n    cuda: needs a CUDA GPU\n")
    if hook:
        pytester.makeconftest(HOOK)
    pytester.makepyfile(test_marked=TESTS)
    return pytester.runpytest("-m", "cuda", "-p", "no:cacheprovider")


def test_one_decorator_marks_and_skips():
    def probe():
        pass

    names = [m.name for m in cuda(probe).pytestmark]
    assert names == ["cuda", "skipif"]
    skip = cuda(probe).pytestmark[1]
    assert skip.args == (not cuda_available(),)


def test_cuda_selects_marked_tests_and_skips_them_without_a_gpu(pytester):
    result = run_marked(pytester, hook=True)
    if cuda_available():
        result.assert_outcomes(passed=3, deselected=1)
    else:
        result.assert_outcomes(skipped=3, deselected=1)


def test_without_the_hook_only_the_plain_mark_would_run(pytester):
    """The decorator carries its own skip (host suites need no conftest); the plain mark relies
    on the hook, which is what tests/conftest.py installs."""
    result = run_marked(pytester, hook=False)
    if cuda_available():
        result.assert_outcomes(passed=3, deselected=1)
    else:
        result.assert_outcomes(passed=1, skipped=2, deselected=1)


@pytest.mark.cuda
def test_this_suite_skips_a_plain_cuda_mark_without_a_gpu():
    assert cuda_available(), "the conftest hook should have skipped this test on a CPU machine"
