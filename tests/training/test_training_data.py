"""Reading the training data: imagefolders whatever their file names, the checks at start-up, and COCO-2014 folders."""

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
    write_images(folder, list(captions))
    write_metadata(folder, [{"file_name": name, "text": text} for name, text in captions.items()], fmt)
    return captions


def load(folder: Path | None, tmp_path: Path, **kwargs) -> datasets.Dataset:
    """The training split of `--train_data_dir folder`, as the trainer reads it."""
    arguments = dict(dataset_name=None, dataset_config_name=None, train_data_dir=folder and str(folder), seed=0,
                     image_column="image", caption_column="text", max_train_samples=None, streaming=False,
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    return load_training_data(**{**arguments, **kwargs})


def refusal(folder: Path | None, tmp_path: Path, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        load(folder, tmp_path, **kwargs)
    return str(error.value)


def captions_by_file(dataset: datasets.Dataset, folder: Path) -> dict[str, str]:
    """Each row's image file (relative to `folder`) and caption, after checking that its pixels are that file's."""
    found, paths = {}, dataset.cast_column("image", datasets.Image(decode=False))["image"]
    for row, path in zip(dataset, paths):
        name = Path(path["path"]).relative_to(folder).as_posix()
        assert np.abs(np.asarray(row["image"], dtype=int)[5, 6] - colour(path["path"])).max() <= 3, name
        assert name not in found, f"{name} is read twice"
        found[name] = row["text"]
    return found


NAMES = {  # datasets alone takes a train split from the names COCO_train2014_… and drops the metadata and captions
    "coco": [f"COCO_train2014_{i:012d}.jpg" for i in (9, 25, 30, 34)],
    # also under folders whose names are split names, when the metadata above them list them
    "subfolders": ["sub/a.png", "sub/deeper/b.png", "train2014/COCO_train2014_1.png", "val2014/COCO_val2014_2.png"],
    "split-words": ["plain-4.png", *(name.format(word) for word in ("test", "val", "dev", "train")
                                     for name in ("{}_0001.png", "img-{}-2.png", "{}.3.png"))],
}  # fmt: skip


@pytest.mark.parametrize("names, fmt", [(names, fmt) for names in NAMES for fmt in FORMATS][:-2])
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


def test_a_local_imagefolder_given_as_dataset_name_points_to_train_data_dir(tmp_path):
    # --dataset_name is read by datasets as it is, split by file names: the message says which flag reads it right.
    write_imagefolder(tmp_path / "data", {"COCO_train2014_1.jpg": "a dog", "COCO_train2014_2.jpg": "a cat"})
    message = "its columns are ['image'] (a local imagefolder: --train_data_dir reads its captions whatever its"
    assert message in refusal(None, tmp_path, dataset_name=str(tmp_path / "data"))


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
    message = f"--dataset_name {folder} has the splits ['validation'] and no 'train' split, which is what the trainer"
    assert message in refusal(None, tmp_path, dataset_name=str(folder))
    message = refusal(None, tmp_path, dataset_name=str(folder), dataset_config_name="default")
    assert re.search(r"written by save_to_disk, .* drop --dataset_config_name default", message), message


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
def test_a_bad_metadata_row_is_refused_by_file_and_row_before_any_read(tmp_path, fmt, change, problem, monkeypatch):
    write_images(tmp_path / "data", ["0.png", "1.png", "2.png"])
    (tmp_path / "0.png").write_bytes((tmp_path / "data" / "0.png").read_bytes())  # ../0.png exists
    rows = [{"file_name": f"{i}.png", "text": f"caption {i}"} for i in range(3)]
    if isinstance(change.get("text"), list):  # a list column: every row holds a list
        rows = [{**row, "text": [row["text"]]} for row in rows]
    rows[2] = {key: value for key, value in {**rows[2], **change}.items() if value is not None or key == "text"}
    metadata = write_metadata(tmp_path / "data", rows, fmt)
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: pytest.fail("an image was decoded"))
    message = refusal(tmp_path / "data", tmp_path)
    where = {"jsonl": "line 3", "csv": "line 4", "parquet": "row 2"}[fmt]  # the third row
    assert message.startswith(f"{metadata} {where} (file_name {rows[2].get('file_name')!r}): ")
    assert problem.format(data=tmp_path / "data") in message
    assert message.endswith(". Every row needs a caption and its image: fix or remove it.")
    assert not (tmp_path / "cache").exists()  # refused before datasets prepares anything


ROWS = [{"file_name": "0.png", "text": "a red circle"}, {"file_name": "1.png", "text": "a blue square"}]
REFUSED = {  # the folder's images, its other files (metadata rows, or bytes), and the distinctive words of the refusal
    "missing": ([], {}, "--train_data_dir {data} is not a folder"),
    "no-metadata": (["cats/1.png", "dogs/3.png"], {"metadata.json": b"{}"},
                    "(metadata.json is not one datasets reads), so its images have no captions: add a metadata.jsonl"),
    "split-folders": (["train/0.png", "test/1.png"], {"test/metadata.jsonl": ROWS[1:]}, "split into folders, and its "
                      "training split has no metadata file (e.g. {data}/test/metadata.jsonl is another split's): put"),
    "two-formats": (["0.png"], {"metadata.jsonl": ROWS[:1], "sub/metadata.csv": ROWS[1:]}, "files mix formats"),
    "no-rows": (["0.png"], {"metadata.jsonl": b"\n"}, "{data}/metadata.jsonl has no rows"),
    "numbers": (["0.png"], {"metadata.csv": [{"file_name": "0.png", "text": 1}]}, "not text: name the caption column"),
    "empty-image": (["0.png", "1.png"], {"metadata.jsonl": ROWS, "1.png": b""}, "its image {data}/1.png cannot"),
    "garbage-image": (["0.png"], {"metadata.jsonl": ROWS[:1], "0.png": b"garbage"}, "its image {data}/0.png cannot"),
    # Captions that mix strings and lists, in one file or across files, which datasets would fail on deep in Arrow
    "mixed": (["0.png", "1.png"], {"metadata.jsonl": [ROWS[0], {**ROWS[1], "text": ["a blue square"]}]},
              "metadata.jsonl line 2 (file_name '1.png'): its caption is a list of captions, where {data}/"
              "metadata.jsonl line 1's is a string: write every caption as a list or every one as a string"),
    "mixed-files": (["0.png", "sub/1.png"], {"metadata.jsonl": [{**ROWS[0], "text": ["a red circle"]}],
                    "sub/metadata.jsonl": ROWS[1:]}, "its caption is a string, where "),
    **{f"caption-column-{fmt}": (["0.png"], {f"metadata.{fmt}": [{"file_name": "0.png", "caption": "a red circle"}]},
       f"{{data}}/metadata.{fmt} has no such field; its rows have 'caption': pass --caption_column caption")
       for fmt in FORMATS},
}  # fmt: skip


@pytest.mark.parametrize("images, files, message", REFUSED.values(), ids=REFUSED)
def test_a_folder_that_cannot_train_is_refused_with_the_fix(tmp_path, images, files, message):
    write_images(tmp_path / "data", images)
    for name, content in files.items():
        if isinstance(content, bytes):
            (tmp_path / "data" / name).write_bytes(content)
        else:
            write_metadata((tmp_path / "data" / name).parent, content, name.rsplit(".", 1)[1])
    assert message.replace("{data}", str(tmp_path / "data")) in refusal(tmp_path / "data", tmp_path)


def test_a_coco_folder_is_read_as_one_row_per_image_with_all_its_captions_unless_another_layout_is_asked(tmp_path):
    coco = write_coco2014(tmp_path / "coco2014", num_train=8, num_val=2, seed=1)
    annotations = json.loads((coco / "annotations" / "captions_train2014.json").read_text())
    dataset = load(coco, tmp_path, data_layout="auto")
    assert dataset.column_names == ["image", "text", "image_id"]  # the captions, not the folder names as labels
    assert dataset["image_id"] == sorted(image["id"] for image in annotations["images"])
    for row, image in zip(dataset, sorted(annotations["images"], key=lambda image: image["id"])):
        assert row["text"] == [a["caption"] for a in annotations["annotations"] if a["image_id"] == row["image_id"]]
        assert row["image"].size == (image["width"], image["height"])
    assert {len(captions) for captions in dataset["text"]} > {5}  # some images have 6 or 7, as in COCO
    assert len(load(coco, tmp_path, data_layout="coco2014")) == 8 and len(load_coco2014(coco, "val2014")) == 2
    assert f"{coco} has no metadata file" in refusal(coco, tmp_path, data_layout="imagefolder")  # as asked
    assert "unknown data layout 'coco'; choose one of" in refusal(coco, tmp_path, data_layout="coco")
    (missing := coco / "annotations" / "captions_train2014.json").unlink()  # partly unpacked: still COCO
    assert f"{coco} is not a COCO-2014 folder: {missing} is missing" in refusal(coco, tmp_path)


def test_a_saved_dataset_with_a_missing_caption_deep_inside_is_refused_at_start_up(tmp_path):
    rows = {"image": [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(96)], "text": [f"c {i}" for i in range(96)]}
    rows["text"][77] = None
    datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"^row 77 of the training data: a caption must be .* got None; fix"):
        load(None, tmp_path, dataset_name=str(tmp_path / "saved"))


@pytest.mark.parametrize(
    "kind, field", [("images", "file_name"), ("images", "id"), ("annotations", "caption"), ("", 3)]
)
def test_a_coco_entry_without_a_field_or_its_image_is_refused_naming_it(tmp_path, kind, field):
    coco = write_coco2014(tmp_path / "coco2014", num_train=4, num_val=1)
    annotations = coco / "annotations" / "captions_train2014.json"
    content = json.loads(annotations.read_text())
    if kind:
        del content[kind][1][field]
        message = rf"_train2014\.json: {kind}\[1\] is .*: each entry needs .*'{field}'"
    else:  # a listed image that the folder lacks
        (victim := sorted((coco / "train2014").iterdir())[field]).unlink()
        message = re.escape(f"lists 1 image(s) that {victim.parent} lacks, e.g. {victim}")
    annotations.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load(coco, tmp_path)
