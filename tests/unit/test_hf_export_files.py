"""What an export writes beside the weights: config.json's special token ids and file modes."""

from __future__ import annotations

import json
import os

from liveshard.runtime.hf.weights import _file_mode, special_token_ids


def _tokenizer(directory, config: dict) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"<s>": 0, "</s>": 1, "hello": 2, "<unk>": 3}, unk_token="<unk>")).save(
        str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_special_token_ids_come_from_the_tokenizer_it_names(tmp_path):
    _tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    assert special_token_ids(tmp_path) == {"bos_token_id": 0, "eos_token_id": 1}


def test_no_ids_for_tokens_it_does_not_name_or_know(tmp_path):
    _tokenizer(tmp_path, {"eos_token": "<|im_end|>"})
    assert special_token_ids(tmp_path) == {}
    assert special_token_ids(tmp_path / "missing") == {}


def test_exported_files_get_the_mode_an_ordinary_write_gets():
    _file_mode.cache_clear()
    old = os.umask(0o027)
    try:
        assert _file_mode() == 0o640
    finally:
        os.umask(old)
    assert _file_mode() == 0o640  # read once per process
    assert os.umask(old) == old  # and left as it was
    _file_mode.cache_clear()
