"""Image prompt files (miles.data.images): JSONL and Parquet records with image parts (paths
relative to the data file, data URIs, bare base64), preprocessing by transformers'
Qwen2VLImageProcessor, and errors naming the file and line for a missing or unreadable image."""

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from PIL import Image

from miles.data.images import load_image_file, preprocess
from miles.data.prompts import DataError


def _png(size, color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _record(image_ref, label="2"):
    return {"prompt": [{"role": "system", "content": "Count."},
                       {"role": "user", "content": [{"type": "image", "image": image_ref},
                                                    {"type": "text", "text": "How many?"}]}],
            "label": label}


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png((84, 56), (255, 0, 0)))
    return tmp_path


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_paths_and_base64_load_in_order(data_dir):
    b64 = base64.b64encode(_png((28, 28), (0, 0, 255))).decode()
    path = _write_jsonl(data_dir / "d.jsonl", [_record("img/a.png"), _record("data:image/png;base64," + b64, 3),
                                               _record(b64)])
    examples = load_image_file(path)
    assert [e.label for e in examples] == ["2", "3", "2"]
    assert examples[0].images[0].size == (84, 56) and examples[0].images[0].getpixel((0, 0)) == (255, 0, 0)
    assert examples[1].images[0].getpixel((3, 3)) == (0, 0, 255) and examples[2].images[0].size == (28, 28)
    assert examples[0].messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "How many?"}]
    assert examples[0].messages[0] == {"role": "system", "content": "Count."}


def test_parquet_matches_jsonl(data_dir):
    # One Parquet column holds one type: every message's content is a parts list here.
    records = [{**r, "prompt": r["prompt"][1:]} for r in (_record("img/a.png"), _record("img/a.png", "5"))]
    pq.write_table(pa.Table.from_pylist(records), data_dir / "d.parquet")
    got = load_image_file(data_dir / "d.parquet")
    want = load_image_file(_write_jsonl(data_dir / "d.jsonl", records))
    assert [(e.messages, e.label) for e in got] == [(e.messages, e.label) for e in want]
    assert got[1].where.endswith("d.parquet, row 2")


def test_missing_image_names_file_and_line(data_dir):
    path = _write_jsonl(data_dir / "d.jsonl", [_record("img/a.png"), _record("img/nope.png")])
    with pytest.raises(DataError, match=r"d\.jsonl, line 2: image file .*img/nope\.png not found"):
        load_image_file(path)


def test_unreadable_image_names_file_and_line(data_dir):
    (data_dir / "img" / "bad.png").write_bytes(b"not a png at all")
    path = _write_jsonl(data_dir / "d.jsonl", [_record("img/bad.png")])
    with pytest.raises(DataError, match=r"d\.jsonl, line 1: unreadable image .*bad\.png"):
        load_image_file(path)


def test_processor_output_feeds_the_vision_tower(data_dir):
    """Qwen2VLImageProcessor (14 px patches, 2 x 2 merge) turns the 84 x 56 image into a 4 x 6 patch
    grid; the tiny Qwen2.5-VL tower merges it into 6 decoder tokens of the decoder's width."""
    from miles.models.config import ArchConfig, VisionConfig
    from miles.models.vision import VisionTower

    example = load_image_file(_write_jsonl(data_dir / "d.jsonl", [_record("img/a.png")]))[0]
    processor = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}, patch_size=14, merge_size=2)
    batch = preprocess(list(example.images) * 2, processor)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6]]
    assert tuple(batch["pixel_values"].shape) == (48, 3 * 2 * 14 * 14)
    direct = processor(images=list(example.images), return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"][:24], direct)
    vision = VisionConfig(out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
    tower = VisionTower(ArchConfig(vocab_size=128, family="qwen2_5_vl", qk_norm=False, attention_bias=True,
                                   vision=VisionConfig(**{**vision.__dict__, "image_token_id": 100, "video_token_id": 101,
                                                          "vision_start_token_id": 102, "vision_end_token_id": 103}),
                                   mrope_section=[2, 3, 3]).vision)
    with torch.no_grad():
        out = tower(batch["pixel_values"], batch["image_grid_thw"])
    assert out.shape == (12, 64) and torch.allclose(out[:6], out[6:], atol=1e-6)
