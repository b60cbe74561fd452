"""Character-level tokenizer for the built-in tasks, plus loading/saving helpers.

`build_char_tokenizer` makes a HF `tokenizers.Tokenizer` with a WordLevel model whose
vocabulary is three special tokens (`<pad>`=0, `<bos>`=1, `<eos>`=2) followed by one id per
alphabet character; a Split pre-tokenizer isolates every character so each one maps to
exactly one id. `save_tokenizer` writes the files `transformers.AutoTokenizer` needs, so the
same directory serves both the HF ecosystem and miles. `special_ids` finds pad/bos/eos ids
for our tokenizers and for foreign ones (via their `tokenizer_config.json`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from miles.data.chat_template import ChatTemplate
from miles.data.tiny_chat import ROLE_TOKENS, TINY_CHAT_TEMPLATE, TOOL_TAGS, chat_alphabet

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
DEFAULT_ALPHABET = "0123456789+-*=() "

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, chat: bool = False) -> Tokenizer:
    """One id per character of `alphabet`, after the special tokens 0..2. `chat`: also the
    printable characters, role markers and tool-call tags of the tiny chat format
    (miles/data/tiny_chat.py), each one token."""
    if chat:
        alphabet = chat_alphabet(alphabet)
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if duplicates:
        raise ValueError(f"alphabet has duplicate characters: {duplicates!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    # No unk token: an out-of-alphabet character is a bug in the task, so encoding should fail
    # loudly instead of silently training on <unk>.
    tok = Tokenizer(models.WordLevel(vocab=vocab))
    # [\s\S] rather than "." so that newlines in an alphabet are isolated too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # WordLevel's default decode joins tokens with spaces; Fuse concatenates them verbatim.
    tok.decoder = decoders.Fuse()
    # Registering the specials makes decode(skip_special_tokens=True) drop them and keeps
    # the text "<eos>" from being split into characters if it ever appears in input.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if chat:
        tok.add_special_tokens(list(ROLE_TOKENS))
        tok.add_tokens([AddedToken(tag, special=False) for tag in TOOL_TAGS])
    return tok


def save_tokenizer(tok: Tokenizer, directory: str | os.PathLike, chat_template: str | None = None) -> Path:
    """Write tokenizer.json + HF config files so AutoTokenizer.from_pretrained(directory) works.

    Only special tokens present in the vocabulary are declared, so this also works for
    tokenizers without a bos token, for example. A tokenizer built with `chat=True` gets the
    tiny chat template unless `chat_template` names another.
    """
    if chat_template is None and tok.token_to_id(ROLE_TOKENS[0]) is not None:
        chat_template = TINY_CHAT_TEMPLATE
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    specials = {
        f"{name}_token": token
        for name, token in zip(("pad", "bos", "eos"), SPECIAL_TOKENS)
        if tok.token_to_id(token) is not None
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # The engine decides where bos/eos go; HF must not add them on its own.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        **specials,
        **({"chat_template": chat_template} if chat_template else {}),
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (out / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(specials, indent=2) + "\n")
    return out


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load `<directory>/tokenizer.json` (written by save_tokenizer or by HF)."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
    return Tokenizer.from_file(str(path))


def _config_token_names(directory: str | os.PathLike) -> dict[str, str]:
    """pad/bos/eos token strings declared in tokenizer_config.json, if any."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    names: dict[str, str] = {}
    for key in ("pad", "bos", "eos"):
        value = config.get(f"{key}_token")
        # Older HF configs store AddedToken dicts instead of plain strings.
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            names[key] = value
    return names


def special_ids(
    tok: Tokenizer, directory: str | os.PathLike | None = None
) -> dict[str, int | None]:
    """Ids of pad/bos/eos (keys "pad", "bos", "eos"); None where the tokenizer has none.

    Token names declared in `<directory>/tokenizer_config.json` win, since that is how a
    foreign tokenizer names its specials (e.g. "</s>"); otherwise miles' own names are used.
    """
    declared = _config_token_names(directory) if directory is not None else {}
    defaults = dict(zip(("pad", "bos", "eos"), SPECIAL_TOKENS))
    return {
        key: tok.token_to_id(declared.get(key, defaults[key])) for key in ("pad", "bos", "eos")
    }


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer with the ids the engine needs."""

    tokenizer: Tokenizer
    pad_id: int | None
    bos_id: int | None
    eos_id: int | None
    vocab_size: int
    chat_template: ChatTemplate | None = None
    # End-of-turn ids besides eos: generation_config.json's eos_token_id (chat models list several)
    extra_stop_ids: tuple[int, ...] = ()

    @classmethod
    def load(cls, directory: str | os.PathLike) -> TokenizerInfo:
        tok = load_tokenizer(directory)
        return replace(cls.from_tokenizer(tok, directory), chat_template=ChatTemplate.load(directory),
                       extra_stop_ids=_generation_eos_ids(directory))

    @classmethod
    def from_tokenizer(
        cls, tok: Tokenizer, directory: str | os.PathLike | None = None
    ) -> TokenizerInfo:
        ids = special_ids(tok, directory)
        return cls(
            tokenizer=tok,
            pad_id=ids["pad"],
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            vocab_size=tok.get_vocab_size(with_added_tokens=True),
        )


def _generation_eos_ids(directory: str | os.PathLike) -> tuple[int, ...]:
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return ()
    ids = json.loads(path.read_text()).get("eos_token_id")
    return tuple(ids) if isinstance(ids, list) else (ids,) if isinstance(ids, int) else ()


def encode_prompt(info: TokenizerInfo, text: str) -> list[int]:
    """Prompt ids as the engine and SFT see them: <bos> (when the tokenizer has one) + the text.
    A text that already starts with the bos token (a chat template that writes it) gets no second."""
    ids = info.tokenizer.encode(text, add_special_tokens=False).ids
    if info.bos_id is None or ids[:1] == [info.bos_id]:
        return ids
    return [info.bos_id] + ids
