"""Chat templates render exactly as transformers' apply_chat_template renders them."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from miles.data.chat_template import ChatTemplate, TemplateError

# ChatML with a default system turn, tool definitions, tool results and a role check (Qwen-style).
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.' }}"
    "{%- if tools %}{{- '\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 12+30?"}],
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "7*6 = ?"}],
    [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "42"},
     {"role": "tool", "content": "{\"x\": 1}"}, {"role": "user", "content": "again"}],
]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "évalue <expr>",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here, saved by transformers with the template."""
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["What is 12+30? Answer with a number. hello again"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                 "<|im_end|>"]))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    out = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(out)
    return out, transformers.AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_equals_transformers(hf_dir, conversation, generation_prompt):
    directory, hf = hf_dir
    ours = ChatTemplate.load(directory)
    assert ours is not None and ours.special_tokens["eos_token"] == "<|im_end|>"
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(conversation, tools=tools, tokenize=False,
                                          add_generation_prompt=generation_prompt)
        assert ours.render(conversation, add_generation_prompt=generation_prompt, tools=tools) == expected


def test_template_errors_are_short_value_errors(hf_dir, tmp_path):
    ours = ChatTemplate.load(hf_dir[0])
    with pytest.raises(TemplateError, match="refused the messages: unknown role robot"):
        ours.render([{"role": "robot", "content": "hi"}])
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% if %}", {}).render([])
    assert ChatTemplate.load(tmp_path) is None  # no tokenizer config, no template file


def test_tokenizer_info_carries_the_template_and_the_end_of_turn_ids(hf_dir, tmp_path):
    import json
    import shutil

    from miles.data.example import Example
    from miles.data.prompt_format import PromptFormat
    from miles.data.tokenizer import TokenizerInfo, encode_prompt

    directory = tmp_path / "tok"
    shutil.copytree(hf_dir[0], directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    info = TokenizerInfo.load(directory)
    assert info.eos_id == 2 and info.extra_stop_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    fmt = PromptFormat(info, True, "Be brief.")
    text = fmt(Example("What is 12+30?", "42"))
    assert text == hf_dir[1].apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+30?"}],
        tokenize=False, add_generation_prompt=True)
    assert encode_prompt(info, text) == hf_dir[1](text, add_special_tokens=False)["input_ids"]
    assert PromptFormat(info, False, "ignored")(Example("raw", "")) == "raw"
