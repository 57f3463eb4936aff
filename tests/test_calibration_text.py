"""Calibration and evaluation text: long documents tokenized in pieces to the same ids as one call
(calibration/data.py `_pieces`), lone surrogates in JSON text, a pipe as the calibration file, a folder without
`datasets`, and `glmq eval`'s windows read from the text's first tokens only."""

from __future__ import annotations

import logging
import os
import random
import threading

import pytest
import torch

from glmq.calibration import data


def _text(chars: int, seed: int = 0) -> str:
    """Prose-like text: words, punctuation, numbers, indented and blank lines, non-ASCII."""
    rng = random.Random(seed)
    words = ["the", "model", "expert", "quantized", "weights", "Über", "naïve", "1234", "x86_64", "GPU's", "—", "(a)",
             "tokens,", "layer.", "😀", "It", "in", "of"]
    lines, n = [], 0
    while n < chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(0, 14)))
        line = rng.choice(["", "  ", "\t", "- "]) + line if rng.random() < 0.2 else line
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def _fast(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def _byte_level_bpe():
    """A GPT-2-style byte-level BPE trained here (merges across letters, spaces before words), as GLM's and
    DeepSeek's tokenizers are."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_text(200_000, seed=1)], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _fast(tok)


def _metaspace():
    """A SentencePiece-style tokenizer: every text it is given starts with "▁", so no cut keeps the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.train_from_iterator([_text(100_000, seed=2)], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>", "<unk>"]))
    return _fast(tok)


def _pieces(tok, text: str, monkeypatch, piece_chars: int) -> tuple[torch.Tensor, int]:
    monkeypatch.setattr(data, "PIECE_CHARS", piece_chars)
    calls = []
    encode = data._encode
    monkeypatch.setattr(data, "_encode", lambda t, s: (calls.append(len(s)), encode(t, s))[1])
    ids = data.token_stream(tok, [text], None)
    return ids, sum(n > 2 * data._CUT_CONTEXT for n in calls)  # the pieces (not the cut checks' contexts)


def test_a_long_text_in_pieces_has_the_ids_of_one_call(monkeypatch):
    tok = _byte_level_bpe()
    text = _text(60_000)
    whole = data._encode(tok, text)
    ids, pieces = _pieces(tok, text, monkeypatch, 1000)
    assert pieces >= 40  # cut about every 1000 characters
    assert torch.equal(ids, whole)


def test_a_tokenizer_that_marks_each_texts_start_is_cut_only_where_the_mark_is_there(monkeypatch):
    """SentencePiece-style: a text given alone gets "▁" in front, so a cut before a word with no space before it would
    change the ids (the local check refuses it); a cut before a space (which becomes that "▁") keeps them."""
    tok = _metaspace()
    text = _text(20_000)
    assert not torch.equal(data._encode(tok, "a\nb"), torch.cat([data._encode(tok, "a\n"), data._encode(tok, "b")]))
    ids, pieces = _pieces(tok, text, monkeypatch, 1000)
    assert pieces > 1 and torch.equal(ids, data._encode(tok, text))


def test_a_bpe_that_splits_no_words_is_never_cut(monkeypatch, caplog):
    """Without a word-splitting pre-tokenizer, merges reach across any cut: here "a\n" pairs merge left to right, so
    a cut after an odd number of them passes a local ids check and yet shifts every pair after it (a reviewer's
    counterexample: 550001 ids in pieces against 550000). Such a tokenizer is never cut; one call, one warning."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "\n": 1, "a\n": 2, "a\na\n": 3, "<eos>": 4}
    for pre in (None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "\n"), ("a\n", "a\n")])) if pre is None else None
        if tok is None:
            from tokenizers import trainers

            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre
            tok.train_from_iterator(["a\n" * 1000], trainers.BpeTrainer(
                vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok = _fast(tok)
        text = "a\n" * 3001
        monkeypatch.setattr(data, "_UNCUT_SAID", [])
        with caplog.at_level(logging.WARNING, logger="glmq"):
            ids, pieces = _pieces(tok, text, monkeypatch, 1001)
        assert pieces == 1 and torch.equal(ids, data._encode(tok, text))
        assert "is tokenized in one call" in caplog.text


def test_lines_that_start_with_markup_are_cut_too(monkeypatch):
    """Cuts are at the tokenizer's own pre-token boundaries, not only at a line starting with a letter: HTML, code
    and Markdown lists are cut as well."""
    tok = _byte_level_bpe()
    text = "\n".join(f"<li>- {w} (x) #{i}</li>" for i, w in enumerate(_text(30_000).split()))
    ids, pieces = _pieces(tok, text, monkeypatch, 1000)
    assert pieces >= 20 and torch.equal(ids, data._encode(tok, text))


def test_the_shared_models_tokenizer_in_pieces_gives_its_ids(shared_model, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_model)
    text = (shared_model.parent / "prose-eval.txt").read_text()
    ids, pieces = _pieces(tok, text, monkeypatch, 4096)
    assert pieces > 50 and torch.equal(ids, data._encode(tok, text))


def test_documents_are_joined_by_eos_and_the_prefix_stops_inside_one(monkeypatch):
    tok = _byte_level_bpe()
    a, b = _text(5000, seed=3), _text(5000, seed=4)
    eos = torch.tensor([tok.eos_token_id])
    want = torch.cat([data._encode(tok, a), eos, data._encode(tok, b)])
    monkeypatch.setattr(data, "PIECE_CHARS", 500)
    assert torch.equal(data.token_stream(tok, ["", a, "", b], None), want)  # empty documents: no EOS of their own
    got = data.token_stream(tok, [a, b], None, prefix=100)
    assert 100 <= got.numel() < want.numel() and torch.equal(got, want[:got.numel()])


def test_a_lone_surrogate_in_json_text_names_the_record(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "fine"}\n{"text": "half an emoji \\ud83d here"}\n')
    with pytest.raises(data.CalibrationDataError, match=rf"{f}:2: the text holds a lone surrogate, \\ud83d at "
                                                        r"character 14"):
        list(data.iter_file(f))
    g = tmp_path / "c.json"
    g.write_text('[{"text": "fine"}, {"text": "\\udc00"}]')
    with pytest.raises(data.CalibrationDataError, match=rf"{g}: item 1: the text holds a lone surrogate"):
        list(data.iter_file(g))
    h = tmp_path / "ok.jsonl"
    h.write_text('{"text": "a pair \\ud83d\\ude00 is fine"}\n')
    assert list(data.iter_file(h)) == ["a pair 😀 is fine"]


def test_a_pipe_is_read_as_a_calibration_file(tmp_path):
    """`--calibration <(zcat corpus.txt.gz)`: a pipe is no regular file, and was taken for a dataset name."""
    tok = _byte_level_bpe()
    text = _text(4000)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as w:
            w.write(text)

    t = threading.Thread(target=feed, daemon=True)  # (a test that fails before reading must not hang)
    t.start()
    got = data.calibration_tokens(tmp_path, str(fifo), samples=2, seq_len=16, tokenizer=tok)
    t.join()
    stream = data._encode(tok, text)
    windows = stream[: stream.numel() // 16 * 16].view(-1, 16)
    assert all(any(torch.equal(row, w) for w in windows) for row in got)


def test_a_folder_without_datasets_is_named_a_folder(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(data.CalibrationDataError, match=rf"{tmp_path} is a folder: give one text file"):
        list(data.iter_dataset(str(tmp_path), 0))


def test_eval_windows_come_from_the_texts_first_tokens(tmp_path, monkeypatch, caplog):
    from glmq.calibration import evaluate
    from glmq.formats.fixtures import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", '
                                                    '"eos_token": "<|endoftext|>"}')
    f = tmp_path / "eval.txt"
    f.write_text(_text(3000))
    n = len(f.read_bytes())
    tok = data.load_tokenizer(tmp_path)
    whole = data._encode(tok, f.read_text())
    assert torch.equal(evaluate.token_windows(tmp_path, f, 50, 4).reshape(-1), whole[:200])
    with caplog.at_level(logging.WARNING, logger="glmq"):
        got = evaluate.token_windows(tmp_path, f, 1000, 500)
    assert got.shape == (n // 1000, 1000)
    assert f"{n} tokens make {n // 1000} windows of 1000, fewer than the 500 asked for" in caplog.text
    with pytest.raises(ValueError, match=rf"{f}: {n} tokens, shorter than one window of {n + 1} tokens"):
        evaluate.token_windows(tmp_path, f, n + 1, 1)


def test_a_pipe_is_refused_for_a_distributed_run(tmp_path):
    """Each rank reads the calibration text itself: a pipe would be split between them, and a shell's /dev/fd/N does
    not reach torchrun's ranks (it was taken for a dataset name)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for spec in (str(fifo), "/dev/fd/63"):
        with pytest.raises(data.CalibrationDataError, match=f"{spec}: not a regular file"):
            data.check_every_rank_reads(spec)
    (tmp_path / "t.txt").write_text("x")
    data.check_every_rank_reads(str(tmp_path / "t.txt"))
    data.check_every_rank_reads("org/dataset")  # a dataset name: each rank loads it
