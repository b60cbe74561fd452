import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles.data.example import Example
from miles.data.prompts import DataError, load_prompt_file


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_round_trip_with_custom_keys(tmp_path):
    path = _write_jsonl(
        tmp_path / "data.jsonl",
        [
            json.dumps({"question": "1+1=", "answer": "2", "extra": 5}),
            "",
            "   ",
            json.dumps({"question": "3*4=", "answer": 12}),
            json.dumps({"question": "0.5+1=", "answer": 1.5}),
        ],
    )
    examples = load_prompt_file(path, prompt_key="question", label_key="answer")
    assert examples == [
        Example("1+1=", "2"),
        Example("3*4=", "12"),
        Example("0.5+1=", "1.5"),
    ]
    assert [ex.fields for ex in examples] == [{"extra": 5}, {}, {}]
    assert all(ex.messages is None for ex in examples)


def test_parquet_round_trip_with_custom_keys(tmp_path):
    path = tmp_path / "data.parquet"
    table = pa.table({"q": ["1+1=", "9-10="], "a": [2, -1], "other": [0, 0]})
    pq.write_table(table, path)
    examples = load_prompt_file(str(path), prompt_key="q", label_key="a")
    assert examples == [
        Example("1+1=", "2"),
        Example("9-10=", "-1"),
    ]
    assert [ex.fields for ex in examples] == [{"other": 0}, {"other": 0}]


def test_malformed_line_names_file_and_line(tmp_path):
    path = _write_jsonl(
        tmp_path / "bad.jsonl",
        [json.dumps({"prompt": "1+1=", "label": "2"}), json.dumps({"prompt": "2+2=", "label": "4"}), "{oops"],
    )
    with pytest.raises(DataError) as err:
        load_prompt_file(path)
    msg = str(err.value)
    assert "bad.jsonl" in msg and "line 3" in msg and "invalid JSON" in msg


def test_missing_key_is_named(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1="})])
    with pytest.raises(DataError, match=r"p\.jsonl, line 1: missing key 'label'"):
        load_prompt_file(path)
    path = _write_jsonl(tmp_path / "q.jsonl", [json.dumps({"text": "1+1=", "label": "2"})])
    with pytest.raises(DataError, match="missing key 'prompt'"):
        load_prompt_file(path)


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": 3, "label": "3"}', "'prompt' is not a string"),
        ('{"prompt": "x", "label": null}', "'label' is not a string, number or list of strings"),
        ('{"prompt": "x", "label": true}', "'label' is not a string, number or list of strings"),
        ('{"prompt": "x", "label": ["a", 1]}', "'label' is not a string, number or list of strings"),
        ('{"prompt": {"role": "user", "content": "x"}, "label": "1"}', "not a string or a messages list"),
        ('{"prompt": [], "label": "1"}', "'prompt' is an empty messages list"),
        ('{"prompt": ["hi"], "label": "1"}', "'prompt' message 1 is not an object: 'hi'"),
        ('{"prompt": [{"content": "hi"}], "label": "1"}', "'prompt' message 1 has no string 'role'"),
        ('{"prompt": [{"role": 1, "content": "hi"}], "label": "1"}', "message 1 has no string 'role'"),
        (
            '{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}], "label": "1"}',
            """message 2 has no string 'content' (use "" for an empty turn)""",
        ),
        (
            '{"prompt": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "label": "1"}',
            "'prompt' has no 'user' message (roles: ['system', 'assistant'])",
        ),
    ],
)
def test_bad_records(tmp_path, line, fragment):
    path = _write_jsonl(tmp_path / "r.jsonl", [json.dumps({"prompt": "a", "label": "b"}), line])
    with pytest.raises(DataError, match="line 2") as err:
        load_prompt_file(path)
    assert fragment in str(err.value)


def test_parquet_missing_column_lists_available(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), path)
    with pytest.raises(DataError) as err:
        load_prompt_file(path)
    msg = str(err.value)
    assert "cols.parquet" in msg and "'question'" in msg and "'answer'" in msg and "'prompt'" in msg


def test_missing_file_unsupported_type_and_empty(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(DataError, match="unsupported"):
        load_prompt_file(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no examples"):
        load_prompt_file(tmp_path / "e.jsonl")
    assert issubclass(DataError, ValueError)


GSM8K_ANSWER_1 = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n24 + 48 = <<24+48=72>>72\n#### 72"
GSM8K_ANSWER_2 = "She earns 12 * 90 = 1,080 dollars.\n#### 1,080"


def test_gsm8k_style_file(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            json.dumps({"question": "How many clips?", "answer": GSM8K_ANSWER_1}),
            json.dumps({"question": "How much does she earn?", "answer": GSM8K_ANSWER_2, "id": 7}),
        ],
    )
    examples = load_prompt_file(path, "question", "answer", label_extractor="gsm8k")
    assert examples == [Example("How many clips?", "72"), Example("How much does she earn?", "1080")]
    # The worked solution is kept for the reward, under its own key.
    assert [ex.fields for ex in examples] == [{"answer": GSM8K_ANSWER_1}, {"answer": GSM8K_ANSWER_2, "id": 7}]


def test_math_style_file_jsonl_and_parquet(tmp_path):
    records = [
        {"problem": "Halve 1.", "solution": "Half of 1 is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
        {"problem": "Compute 2+3.", "solution": "First \\boxed{4}? No: \\boxed{5}", "level": "Level 2"},
    ]
    jsonl = _write_jsonl(tmp_path / "math.jsonl", [json.dumps(r) for r in records])
    parquet = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    for path in (jsonl, parquet):
        examples = load_prompt_file(path, "problem", "solution", label_extractor="boxed")
        assert examples == [Example("Halve 1.", "\\frac{1}{2}"), Example("Compute 2+3.", "5")]
        assert [ex.fields for ex in examples] == [
            {"level": "Level 1", "solution": records[0]["solution"]},
            {"level": "Level 2", "solution": records[1]["solution"]},
        ]


def test_extractor_finding_nothing_names_file_line_and_label(tmp_path):
    long_solution = "No marker here, " + "x" * 200
    path = _write_jsonl(
        tmp_path / "g.jsonl",
        [json.dumps({"q": "a", "a": "#### 1"}), json.dumps({"q": "b", "a": long_solution})],
    )
    with pytest.raises(DataError) as err:
        load_prompt_file(path, "q", "a", label_extractor="gsm8k")
    msg = str(err.value)
    assert f"{path}, line 2: label_extractor 'gsm8k' found no answer in 'a': 'No marker here, xxx" in msg
    excerpt = msg.split("found no answer in 'a': ")[1]  # the solution, cut (the path's length varies)
    assert excerpt.endswith("...'") and len(excerpt) < len(long_solution)

    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"problem": ["p", "q"], "solution": ["\\boxed{1}", "just 2"]}), parquet)
    with pytest.raises(DataError, match=r"b\.parquet, row 2: label_extractor 'boxed' found no answer in 'solution': 'just 2'"):
        load_prompt_file(parquet, "problem", "solution", label_extractor="boxed")


def test_unknown_extractor_lists_valid_ones(tmp_path):
    # Checked before the file is even opened: it is a config mistake, not a data one.
    with pytest.raises(ValueError, match=r"unknown label_extractor 'latex'; valid: \['boxed', 'gsm8k', 'plain'\]"):
        load_prompt_file(tmp_path / "missing.jsonl", label_extractor="latex")


def test_plain_label_list_of_strings_is_joined(tmp_path):
    tests = ["assert f(1) == 2", "assert f(2) == 3"]
    path = _write_jsonl(tmp_path / "code.jsonl", [json.dumps({"prompt": "Write f.", "label": tests})])
    [example] = load_prompt_file(path)
    assert example == Example("Write f.", "assert f(1) == 2\nassert f(2) == 3")
    assert example.fields == {}  # plain never copies the label into fields


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1+1?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": {"expr": "1+1"}}]},
    {"role": "tool", "content": "2", "name": "calc"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2+2?"},
]


def test_messages_jsonl(tmp_path):
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            json.dumps({"messages": CONVERSATION, "answer": 4, "source": "demo"}),
            json.dumps({"messages": [{"role": "user", "content": "Hi"}], "answer": "Hello"}),
        ],
    )
    first, second = load_prompt_file(path, "messages", "answer")
    assert first == Example("And 2+2?", "4", messages=tuple(CONVERSATION))
    assert first.fields == {"source": "demo"}
    assert second == Example("Hi", "Hello", messages=({"role": "user", "content": "Hi"},))
    assert second.fields == {}


def test_messages_parquet_list_of_struct(tmp_path):
    messages = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?", "name": "ann"}],
        [{"role": "user", "content": "2+2?"}],
    ]
    table = pa.table({"prompt": messages, "label": [["2"], ["4", "four"]], "tags": [["a"], []]})
    path = tmp_path / "chat.parquet"
    pq.write_table(table, path)
    first, second = load_prompt_file(path)
    # The struct's "name" is None on turns that lack it; it is dropped, as if read from JSONL.
    assert first == Example("1+1?", "2", messages=tuple(messages[0]))
    assert second == Example("2+2?", "4\nfour", messages=tuple(messages[1]))
    assert json.loads(json.dumps([first.fields, second.fields])) == [{"tags": ["a"]}, {"tags": []}]


def test_messages_parquet_errors_name_the_row(tmp_path):
    path = tmp_path / "bad_chat.parquet"
    table = pa.table({"prompt": [[{"role": "user", "content": "x"}], [{"role": "system", "content": "y"}]], "label": ["1", "2"]})
    pq.write_table(table, path)
    with pytest.raises(DataError, match=r"bad_chat\.parquet, row 2: 'prompt' has no 'user' message"):
        load_prompt_file(path)
    path = tmp_path / "null_content.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": None}]], "label": ["1"]}), path)
    with pytest.raises(DataError, match=r"row 1: 'prompt' message 1 has no string 'content'"):
        load_prompt_file(path)


def test_parquet_column_that_is_not_json_serializable(tmp_path):
    path = tmp_path / "img.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "label": ["1"], "image": [b"\x89PNG"]}), path)
    with pytest.raises(DataError, match=r"img\.parquet: column 'image' has type binary, which is not JSON-serializable"):
        load_prompt_file(path)
