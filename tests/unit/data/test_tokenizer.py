import json

import pytest
import transformers

from miles.data.tokenizer import (
    TokenizerInfo,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
    special_ids,
)


def test_each_char_is_one_id_and_decode_round_trips():
    tok = build_char_tokenizer()
    ids = tok.encode("12+34=").ids
    assert len(ids) == 6
    # Vocabulary order is the three specials, then the alphabet "0123456789+-*=() ".
    assert ids == [4, 5, 13, 6, 7, 16]
    assert tok.decode(ids) == "12+34="
    assert tok.decode(tok.encode("(7 - 3)*2").ids) == "(7 - 3)*2"


def test_special_token_ids_and_no_auto_bos():
    tok = build_char_tokenizer()
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert special_ids(tok) == {"pad": 0, "bos": 1, "eos": 2}
    # No post-processor: the engine decides where bos goes.
    assert tok.encode("1").ids == [4]
    assert tok.decode([1, 4, 2, 0], skip_special_tokens=True) == "1"
    assert tok.get_vocab_size() == 3 + len("0123456789+-*=() ")


def test_out_of_alphabet_character_fails():
    with pytest.raises(Exception):
        build_char_tokenizer("01").encode("2")


def test_duplicate_alphabet_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer("0011")


def test_save_load_and_autotokenizer(tmp_path):
    tok = build_char_tokenizer()
    save_tokenizer(tok, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).is_file()

    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("12+34=").ids == tok.encode("12+34=").ids

    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(hf, transformers.PreTrainedTokenizerFast)
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (0, 2, 1)
    assert hf("12+34=")["input_ids"] == tok.encode("12+34=").ids
    assert hf.decode(tok.encode("99*9=").ids) == "99*9="

    info = TokenizerInfo.load(tmp_path)
    assert (info.pad_id, info.bos_id, info.eos_id, info.vocab_size) == (0, 1, 2, 20)


def test_special_ids_of_foreign_tokenizer_come_from_config(tmp_path):
    # A "foreign" tokenizer: specials named differently, no bos at all.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "</s>": 1, "a": 2}
    tok = Tokenizer(models.WordLevel(vocab=vocab))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert special_ids(tok) == {"pad": None, "bos": None, "eos": None}

    config = {"pad_token": "[PAD]", "eos_token": {"content": "</s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert special_ids(load_tokenizer(tmp_path), tmp_path) == {"pad": 0, "bos": None, "eos": 1}
