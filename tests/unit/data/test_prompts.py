import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles.data.arithmetic import Example
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
    assert load_prompt_file(path, prompt_key="question", label_key="answer") == [
        Example("1+1=", "2"),
        Example("3*4=", "12"),
        Example("0.5+1=", "1.5"),
    ]


def test_parquet_round_trip_with_custom_keys(tmp_path):
    path = tmp_path / "data.parquet"
    table = pa.table({"q": ["1+1=", "9-10="], "a": [2, -1], "other": [0, 0]})
    pq.write_table(table, path)
    assert load_prompt_file(str(path), prompt_key="q", label_key="a") == [
        Example("1+1=", "2"),
        Example("9-10=", "-1"),
    ]


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
        ('{"prompt": "x", "label": null}', "'label' is not a string or number"),
        ('{"prompt": "x", "label": true}', "'label' is not a string or number"),
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
