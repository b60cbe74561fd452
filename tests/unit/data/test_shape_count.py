"""The generated count-the-shapes task (miles.data.shape_count): the label is the number of shapes
of the asked colour actually drawn (read back from the pixels), splits are seeded and disjoint,
and the files load through miles.data.images."""

from miles.data.images import load_image_file
from miles.data.shape_count import COLOURS, reward, scene, split_scenes, write_split


def _counted_in_pixels(s) -> int:
    """Shapes of the asked colour read back from the image: one per cell whose centre has that colour."""
    image, half = s.render(), s.cell // 2
    return sum(image.getpixel((c * s.cell + half, r * s.cell + half + half // 2)) == COLOURS[s.colour]
               for r in range(s.grid) for c in range(s.grid))


def test_labels_match_the_drawn_pixels():
    scenes = split_scenes(0, "train", 40)
    assert [_counted_in_pixels(s) for s in scenes] == [s.answer for s in scenes]
    assert {s.answer for s in scenes} >= {0, 1, 2}  # the answers vary, zero included


def test_splits_are_seeded_and_held_out():
    assert scene(3, "train", 7) == scene(3, "train", 7) and scene(3, "train", 7) != scene(4, "train", 7)
    train = split_scenes(0, "train", 200)
    held_out = split_scenes(0, "eval", 50, train_size=200)
    assert len(held_out) == 50 and not set(held_out) & set(train)


def test_written_split_loads_as_image_records(tmp_path):
    scenes = split_scenes(1, "eval", 3, train_size=10)
    examples = load_image_file(write_split(tmp_path, scenes, "eval"))
    assert [e.label for e in examples] == [str(s.answer) for s in scenes]
    assert examples[0].images[0].size == (84, 84)
    assert examples[0].messages[0]["content"][1]["text"] == scenes[0].question


def test_reward_takes_the_last_integer():
    assert reward("I see 2 red... no, 3", "3") == 1.0
    assert reward("There are 2.", "3") == 0.0 and reward("none", "0") == 0.0 and reward("0", "0") == 1.0
