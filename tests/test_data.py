"""WikiText-2 loading (the GPTQ join), token caching, eval and calibration windows."""
import pytest
import torch

from quantlab.models.data import (
    calibration_windows,
    eval_windows,
    find_wikitext2_dir,
    load_text,
    load_token_ids,
    tokenize,
)


def test_wikitext2_test_is_the_gptq_string(wikitext_dir):
    text, source = load_text("wikitext2", "test", wikitext_dir)
    assert len(text) == 1_294_336  # shared/data/README.md
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert")
    assert "rows joined" in source


def test_validation_split_is_a_different_text(wikitext_dir):
    valid, _ = load_text("wikitext2", "validation", wikitext_dir)
    test, _ = load_text("wikitext2", "test", wikitext_dir)
    assert valid.lstrip().startswith("= Homarus gammarus =") and valid[:2000] not in test


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="data directory '.*nope' does not exist"):
        find_wikitext2_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="lacks wiki.test.rows.jsonl, wiki.valid.tokens"):
        find_wikitext2_dir(tmp_path)
    with pytest.raises(ValueError, match="unknown split 'train'; known: test, validation"):
        load_text("wikitext2", "train")
    with pytest.raises(FileNotFoundError, match="neither a known dataset"):
        load_text("wikitext3", "test")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_token_ids(str(empty), "test", tokenizer=None)


def test_local_text_file_and_token_cache(tiny_model, tmp_path, tiny_model_dir):
    _, tok = tiny_model
    ids, source = load_token_ids(str(tiny_model_dir / "sample.txt"), "test", tok, cache_dir=tmp_path)
    assert source == "file:sample.txt" and ids.dtype == torch.long and ids.numel() > 500
    cached = list((tmp_path / "tokens").glob("*.npy"))
    assert len(cached) == 1
    again = tokenize((tiny_model_dir / "sample.txt").read_text(), tok, cache_dir=tmp_path)
    assert torch.equal(ids, again)
    assert ids[0].item() != tok.bos_token_id  # no BOS added


def test_eval_windows_are_non_overlapping_and_budgeted():
    ids = torch.arange(1000)
    w = eval_windows(ids, 128)
    assert w.shape == (7, 128) and torch.equal(w.reshape(-1), ids[:896])
    assert eval_windows(ids, 128, max_windows=3).shape == (3, 128)
    assert eval_windows(ids, 128, max_tokens=300).shape == (2, 128)
    with pytest.raises(ValueError, match="text has 1000 tokens, fewer than one window of seq_len=2048"):
        eval_windows(ids, 2048)


def test_spread_windows_sample_the_whole_split():
    ids = torch.arange(1000)  # 7 windows of 128: 0..6
    every = eval_windows(ids, 128)
    assert torch.equal(eval_windows(ids, 128, max_windows=3, order="spread"), every[[0, 3, 6]])
    assert torch.equal(eval_windows(ids, 128, max_windows=4, order="spread"), every[[0, 2, 4, 6]])
    assert torch.equal(eval_windows(ids, 128, max_windows=1, order="spread"), every[:1])
    assert torch.equal(eval_windows(ids, 128, max_tokens=300, order="spread"), every[[0, 6]])
    assert torch.equal(eval_windows(ids, 128, order="spread"), every)  # no limit: every window, as "first"
    assert torch.equal(eval_windows(ids, 128, max_windows=9, order="spread"), every)
    spread = eval_windows(ids, 128, max_windows=5, order="spread", bos_id=-1)  # BOS + 127 text tokens: 7 windows,
    # positions linspace(0, 6, 5) = 0, 1.5, 3, 4.5, 6 rounded half to even
    assert spread[:, 0].eq(-1).all() and torch.equal(spread[:, 1], torch.tensor([0, 2, 3, 4, 6]) * 127)
    assert len({int(w[1]) for w in spread}) == 5  # distinct windows, never one twice
    with pytest.raises(ValueError, match="window order 'random' unknown; known: first, spread"):
        eval_windows(ids, 128, max_windows=3, order="random")


def test_calibration_windows_are_seeded():
    ids = torch.arange(5000)
    a, b = calibration_windows(ids, 8, 64, seed=0), calibration_windows(ids, 8, 64, seed=0)
    c = calibration_windows(ids, 8, 64, seed=1)
    assert a.shape == (8, 64) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(8, 63, dtype=torch.long))  # contiguous spans
    with pytest.raises(ValueError, match="calibration text has 50 tokens; samples of seq_len=64 need more"):
        calibration_windows(torch.arange(50), 4, 64, seed=0)
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        calibration_windows(ids, 0, 64, seed=0)


def test_text_files_that_are_not_utf8_name_the_file_and_the_byte(tmp_path):
    """A dataset path (`[eval] dataset = "file.txt"`) and the wikitext-2 files of a --data-dir alike."""
    (tmp_path / "notes.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"notes\.txt: not a UTF-8 text file \('utf-8' codec can't decode byte 0xe9 "
                                         r"in position 3: invalid continuation byte\); save it as UTF-8"):
        load_text(str(tmp_path / "notes.txt"), "test")
    data = tmp_path / "wikitext-2"
    data.mkdir()
    (data / "wiki.test.rows.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (data / "wiki.valid.tokens").write_bytes(b"\xff valid\n")
    with pytest.raises(ValueError, match=r"wiki\.test\.rows\.jsonl: not a UTF-8 text file \('utf-8' codec can't "
                                         r"decode byte 0xe9 in position 28: invalid continuation byte"):
        load_text("wikitext2", "test", data)
    with pytest.raises(ValueError, match=r"wiki\.valid\.tokens: not a UTF-8 text file .*byte 0xff in position 0"):
        load_text("wikitext2", "validation", data)
