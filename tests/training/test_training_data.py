"""Reading the training data (`diffusers_lmlp.training.data`): imagefolders whatever their file names, the checks at
start-up, and telling the COCO-2014 layout from an imagefolder."""

import csv
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
from coco_fixture import write_coco2014
from PIL import Image

from diffusers_lmlp.training import load_coco2014, load_training_data


FORMATS = ("jsonl", "csv", "parquet")


def colour(path: str) -> tuple[int, int, int]:
    """The colour of the image written at a path: a function of the path alone."""
    value = sum(ord(c) * 31**k for k, c in enumerate(path))
    return (value % 7 * 36, value // 7 % 7 * 36, value // 49 % 7 * 36)


def write_images(folder: Path, names: list[str]) -> None:
    for path in (folder / name for name in names):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), colour(str(path))).save(path)


def write_metadata(folder: Path, rows: list[dict], fmt: str) -> Path:
    """`folder/metadata.<fmt>` with these rows (a CSV has "" where a row has no column)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"metadata.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def write_imagefolder(folder: Path, captions: dict[str, str], fmt: str = "jsonl") -> dict[str, str]:
    """An imagefolder of these file names and captions; returns `captions`."""
    write_images(folder, list(captions))
    write_metadata(folder, [{"file_name": name, "text": text} for name, text in captions.items()], fmt)
    return captions


def load(folder: Path | None, tmp_path: Path, **kwargs) -> datasets.Dataset:
    """The training split of `--train_data_dir folder`, as the trainer reads it."""
    arguments = dict(
        dataset_name=None, dataset_config_name=None, train_data_dir=folder and str(folder), image_column="image",
        caption_column="text", max_train_samples=None, streaming=False, seed=0, cache_dir=str(tmp_path / "cache")
    )  # fmt: skip
    return load_training_data(**{**arguments, **kwargs})


def refusal(folder: Path | None, tmp_path: Path, **kwargs) -> str:
    """The message `load` refuses the data with."""
    with pytest.raises(ValueError) as error:
        load(folder, tmp_path, **kwargs)
    return str(error.value)


def captions_by_file(dataset: datasets.Dataset, folder: Path) -> dict[str, str]:
    """Each row's image file (relative to `folder`) and caption, after checking that its pixels are that file's."""
    paths = dataset.cast_column("image", datasets.Image(decode=False))["image"]
    found = {}
    for row, path in zip(dataset, paths):
        name = Path(path["path"]).relative_to(folder).as_posix()
        assert np.abs(np.asarray(row["image"], dtype=int)[5, 6] - colour(path["path"])).max() <= 3, name
        assert name not in found, f"{name} is read twice"
        found[name] = row["text"]
    return found


# ------------------------------------------------------------------------------- imagefolders, whatever their names


NAMES = {  # datasets alone takes a train split from the names COCO_train2014_… and drops the metadata and captions
    "coco": [f"COCO_train2014_{i:012d}.jpg" for i in (9, 25, 30, 34)],
    # also under folders whose names are split names, when the metadata above them list them
    "subfolders": ["sub/a.png", "sub/deeper/b.png", "train2014/COCO_train2014_1.png", "val2014/COCO_val2014_2.png"],
    **{word: [f"{word}_0001.png", f"img-{word}-2.png", f"{word}.3.png", "plain-4.png"] for word in ("test", "val",
                                                                                                      "dev", "train")}
}  # fmt: skip


@pytest.mark.parametrize(
    "names, fmt", [(names, fmt) for names in ("coco", "subfolders") for fmt in FORMATS] + [(w, "jsonl") for w in NAMES]
)
def test_images_are_read_with_their_captions_whatever_their_names(tmp_path, names, fmt):
    captions = write_imagefolder(tmp_path / "data", {name: f"caption of {name}" for name in NAMES[names]}, fmt)
    assert captions_by_file(load(tmp_path / "data", tmp_path), tmp_path / "data") == captions


def test_train_and_test_folders_train_on_the_train_folder_alone(tmp_path):
    data = tmp_path / "data"
    train = write_imagefolder(data / "train", {f"COCO_train2014_{i}.jpg": f"train caption {i}" for i in range(3)})
    write_imagefolder(data / "test", {f"COCO_train2014_{i}.jpg": f"test caption {i}" for i in range(2)})
    with open(data / "test" / "metadata.jsonl", "a") as f:  # the test split's problems are not the training's
        f.write(json.dumps({"file_name": "gone.jpg", "text": ""}) + "\n")
    assert captions_by_file(load(data, tmp_path), data) == {f"train/{name}": text for name, text in train.items()}


def test_a_local_imagefolder_given_as_dataset_name_points_to_train_data_dir_and_a_missing_folder_is_named(tmp_path):
    assert f"--train_data_dir {tmp_path / 'nowhere'} is not a folder" in refusal(tmp_path / "nowhere", tmp_path)
    # --dataset_name is read by datasets as it is, split by file names: the message says which flag reads it right.
    write_imagefolder(tmp_path / "data", {"COCO_train2014_1.jpg": "a dog", "COCO_train2014_2.jpg": "a cat"})
    assert refusal(None, tmp_path, dataset_name=str(tmp_path / "data")) == (
        "--caption_column 'text' is not a column of the dataset; its columns are ['image'] (a local imagefolder: "
        "--train_data_dir reads its captions whatever its file names are)"
    )


def saved_dataset(tmp_path: Path, as_dict: bool, split: str = "train") -> tuple[Path, datasets.Dataset]:
    """An imagefolder read by `datasets`, then written by `save_to_disk`: a `Dataset`, or a `DatasetDict`."""
    write_imagefolder(tmp_path / "data", {f"{i}.png": f"caption {i}" for i in range(6)})
    original = load(tmp_path / "data", tmp_path)
    saved = datasets.DatasetDict({split: original}) if as_dict else original
    saved.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved", original


@pytest.mark.parametrize("as_dict", [False, True], ids=["Dataset", "DatasetDict"])
def test_a_folder_written_by_save_to_disk_is_read_as_it_was_saved(tmp_path, as_dict):
    folder, original = saved_dataset(tmp_path, as_dict)  # which datasets' load_dataset refuses
    dataset = load(None, tmp_path, dataset_name=str(folder))
    assert list(dataset["text"]) == list(original["text"])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(dataset["image"], original["image"]))
    # The same fingerprint at every load: the feature store is found again by the next run.
    assert load(None, tmp_path, dataset_name=str(folder))._fingerprint == dataset._fingerprint
    streamed = load(None, tmp_path, dataset_name=str(folder), streaming=True, max_train_samples=4)
    assert isinstance(streamed, datasets.IterableDataset)
    assert [row["text"] for row in streamed] == list(original["text"])[:4]


def test_a_saved_dataset_without_a_train_split_or_with_a_config_name_is_refused(tmp_path):
    folder, _ = saved_dataset(tmp_path, as_dict=True, split="validation")
    assert refusal(None, tmp_path, dataset_name=str(folder)) == (
        f"--dataset_name {folder} has the splits ['validation'] and no 'train' split, which is what the trainer reads: "
        "save or name the training data as 'train'"
    )
    message = refusal(None, tmp_path, dataset_name=str(folder), dataset_config_name="default")
    assert re.search(r"written by save_to_disk, .* drop --dataset_config_name default", message), message


# --------------------------------------------------------------------------------------- metadata checks at start-up


def where(fmt: str, index: int) -> str:
    """How a message names row `index` (from 0) of a metadata file: its line, or its index in a parquet file."""
    return {"jsonl": f"line {index + 1}", "csv": f"line {index + 2}", "parquet": f"row {index}"}[fmt]


# A parquet file was once not checked at all, and pandas reads "null", "NA" … of a CSV file as missing values.
BAD_ROWS = [
    ("parquet", {"text": None}, "a caption must be a non-empty string or a non-empty list of them, got None"),
    ("parquet", {"text": ""}, "got ''"), ("parquet", {"text": ["a dog", " "]}, "got ['a dog', ' ']"),
    ("parquet", {"text": []}, "got []"),
    ("csv", {"text": "null"}, "its caption 'null' reads as a missing value (datasets reads metadata.csv with pandas)"),
    ("csv", {"text": "NA"}, "its caption 'NA' reads as a missing value"),
    ("jsonl", {"file_name": None}, "it has no file_name (the image's path relative to the metadata file)"),
    ("jsonl", {"file_name": "../0.png"}, "its file_name must be a path inside"),
    *((fmt, {"file_name": "sub/gone.png"}, "its image {data}/sub/gone.png is missing") for fmt in FORMATS)
]  # fmt: skip


@pytest.mark.parametrize("fmt, change, problem", BAD_ROWS)
def test_a_bad_metadata_row_is_refused_naming_the_file_and_the_row_before_anything_is_read(
    tmp_path, fmt, change, problem, monkeypatch
):
    write_images(tmp_path / "data", ["0.png", "1.png", "2.png"])
    (tmp_path / "0.png").write_bytes((tmp_path / "data" / "0.png").read_bytes())  # ../0.png exists
    rows = [{"file_name": f"{i}.png", "text": f"caption {i}"} for i in range(3)]
    if isinstance(change.get("text"), list):  # a list column: every row holds a list
        rows = [{**row, "text": [row["text"]]} for row in rows]
    rows[2] = {key: value for key, value in {**rows[2], **change}.items() if value is not None or key == "text"}
    metadata = write_metadata(tmp_path / "data", rows, fmt)
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: pytest.fail("an image was decoded"))
    message = refusal(tmp_path / "data", tmp_path)
    assert message.startswith(f"{metadata} {where(fmt, 2)} (file_name {rows[2].get('file_name')!r}): ")
    assert problem.format(data=tmp_path / "data") in message
    assert message.endswith(". Every row needs a caption and its image: fix or remove it.")
    assert not (tmp_path / "cache").exists()  # refused before datasets prepares anything


@pytest.mark.parametrize("fmt", FORMATS)
def test_another_caption_column_is_named_with_the_flag_to_pass(tmp_path, fmt):
    write_images(tmp_path / "data", ["0.png", "1.png"])
    rows = [{"file_name": "0.png", "caption": "a red circle"}, {"file_name": "1.png", "caption": "a blue square"}]
    metadata = write_metadata(tmp_path / "data", rows, fmt)
    assert refusal(tmp_path / "data", tmp_path) == (
        f"--caption_column 'text' is not a column of the dataset: {metadata} has no such field; its rows have "
        "'caption': pass --caption_column caption"
    )


def test_captions_that_mix_strings_and_lists_are_refused_before_datasets_fails_on_them(tmp_path):
    write_images(tmp_path / "data", ["0.png", "1.png", "sub/2.png"])
    rows = [{"file_name": "0.png", "text": "a red circle"}, {"file_name": "1.png", "text": ["a blue square", "x"]}]
    metadata = write_metadata(tmp_path / "data", rows, "jsonl")  # datasets would fail deep in Arrow on it
    assert refusal(tmp_path / "data", tmp_path) == (
        f"{metadata} line 2 (file_name '1.png'): its caption is a list of captions, where {metadata} line 1's is a "
        "string: write every caption as a list or every one as a string. Every row needs a caption and its image: fix "
        "or remove it."
    )
    assert not (tmp_path / "cache").exists()
    # Across the metadata files of one dataset too; all lists is fine, and reads every caption.
    rows[0]["text"] = ["a red circle"]
    write_metadata(tmp_path / "data", rows, "jsonl")
    write_metadata(tmp_path / "data" / "sub", [{"file_name": "2.png", "text": "a green star"}], "jsonl")
    assert "its caption is a string, where " in refusal(tmp_path / "data", tmp_path)
    write_metadata(tmp_path / "data" / "sub", [{"file_name": "2.png", "text": ["a green star"]}], "jsonl")
    expected = [("a blue square", "x"), ("a green star",), ("a red circle",)]
    assert sorted(map(tuple, load(tmp_path / "data", tmp_path)["text"])) == expected


def test_metadata_of_two_formats_or_without_rows_are_refused(tmp_path):
    write_imagefolder(tmp_path / "data", {"0.png": "a red circle"})
    write_metadata(tmp_path / "data" / "sub", [{"file_name": "x.png", "text": "a blue square"}], "csv")
    assert re.search(r"the metadata files mix formats \(\.csv, \.jsonl\)", refusal(tmp_path / "data", tmp_path))
    (tmp_path / "data" / "sub" / "metadata.csv").unlink()
    (tmp_path / "data" / "metadata.jsonl").write_text("\n")
    assert f"{tmp_path / 'data' / 'metadata.jsonl'} has no rows" in refusal(tmp_path / "data", tmp_path)


# ---------------------------------------------------------------------------------------------- the folder's layout


def test_a_coco_folder_is_read_as_coco_unless_another_layout_is_asked(tmp_path):
    coco = write_coco2014(tmp_path / "coco2014", num_train=4, num_val=2)
    dataset, expected = load(coco, tmp_path, data_layout="auto"), load_coco2014(coco)
    assert dataset.column_names == ["image", "text", "image_id"]
    assert len(load(coco, tmp_path, data_layout="coco2014")) == 4
    assert dataset["image_id"] == expected["image_id"] and dataset["text"] == expected["text"]
    assert all(len(captions) >= 5 for captions in dataset["text"])  # the captions, not the folder names as labels
    assert f"{coco} has no metadata file" in refusal(coco, tmp_path, data_layout="imagefolder")  # as asked
    assert "unknown data layout 'coco'; choose one of" in refusal(coco, tmp_path, data_layout="coco")
    (coco / "annotations" / "captions_train2014.json").unlink()  # partly unpacked: still COCO, naming what is missing
    with pytest.raises(ValueError, match=re.escape(f"{coco} is not a COCO-2014 folder: "
                                                   f"{coco / 'annotations' / 'captions_train2014.json'} is missing")):  # fmt: skip
        load(coco, tmp_path)


def test_an_imagefolder_without_metadata_is_refused_saying_captions_are_needed(tmp_path):
    write_images(tmp_path / "data", ["cats/1.png", "cats/2.png", "dogs/3.png"])  # datasets would label cats, dogs
    (tmp_path / "data" / "metadata.json").write_text("{}")  # not a name datasets reads
    assert refusal(tmp_path / "data", tmp_path) == (
        f"{tmp_path / 'data'} has no metadata file (metadata.csv, metadata.jsonl, metadata.parquet) (metadata.json is "
        "not one datasets reads), so its images have no captions: add a metadata.jsonl, one line per image "
        '({"file_name": "0001.jpg", "text": "a red bus"}), or pass a COCO-2014 folder'
    )


def test_split_folders_whose_training_one_has_no_metadata_are_refused(tmp_path):
    write_images(tmp_path / "data", ["train/0.png"])
    write_imagefolder(tmp_path / "data" / "test", {"1.png": "a test image"})
    assert refusal(tmp_path / "data", tmp_path) == (
        f"{tmp_path / 'data'} is split into folders, and its training split has no metadata file (e.g. "
        f"{tmp_path / 'data' / 'test' / 'metadata.jsonl'} is another split's): put the training images and their "
        f"metadata in {tmp_path / 'data' / 'train'}"
    )


# ------------------------------------------------------------------------- bad data is found at start-up (issue 54)


def test_a_saved_dataset_with_a_missing_caption_deep_inside_is_refused_at_start_up(tmp_path):
    rows = {"image": [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(96)], "text": [f"c {i}" for i in range(96)]}
    rows["text"][77] = None
    datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(
        ValueError, match=r"^row 77 of the training data: a caption must be .* got None; fix or remove"
    ):
        load(None, tmp_path, dataset_name=str(tmp_path / "saved"))


@pytest.mark.parametrize("content", [b"", b"not an image"], ids=["empty", "garbage"])
def test_an_image_that_cannot_be_opened_is_refused_at_start_up_naming_it(tmp_path, content):
    write_imagefolder(tmp_path / "data", {f"{i}.png": f"caption {i}" for i in range(4)})
    (tmp_path / "data" / "2.png").write_bytes(content)
    message = refusal(tmp_path / "data", tmp_path)
    assert re.search(r"^row \d of the training data: its image \S+2\.png cannot be read", message), message


def test_a_metadata_csv_of_numeric_captions_is_refused_as_numbers(tmp_path):
    write_images(tmp_path / "data", ["0.png", "1.png"])
    write_metadata(tmp_path / "data", [{"file_name": "0.png", "text": 1}, {"file_name": "1.png", "text": 2}], "csv")
    assert re.search(r"^--caption_column 'text' holds .*int64.*, not text", refusal(tmp_path / "data", tmp_path))


@pytest.mark.parametrize("kind, field", [("images", "file_name"), ("images", "id"), ("annotations", "caption")])
def test_a_coco_entry_without_a_field_is_refused_naming_the_entry(tmp_path, kind, field):
    coco = write_coco2014(tmp_path / "coco2014", num_train=3, num_val=1)
    annotations = coco / "annotations" / "captions_train2014.json"
    content = json.loads(annotations.read_text())
    del content[kind][1][field]
    annotations.write_text(json.dumps(content))
    with pytest.raises(
        ValueError, match=rf"captions_train2014\.json: {kind}\[1\] is .*: each entry needs .*'{field}'"
    ):
        load(coco, tmp_path)
