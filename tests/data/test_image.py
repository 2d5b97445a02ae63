"""mgk.data.image: CIFAR pickle batches and image folders (plain and archived), grey conversion, pixel 0 not padding,
errors naming the file, the shared JPEG copy."""
from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mgk.data import image as im
from mgk.data.samples import (
    cifar_batch,
    cifar_pickle_files,
    encode_image,
    image_folder_files,
    make_cifar_pickle_dir,
    write_files,
    write_tar,
)
from mgk.tasks.text import LRAClassificationTask

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"  # the shared data copy next to the repository


def test_grey_formula_is_pillows_convert_L():
    from PIL import Image

    rgb = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    rgb[0, :4] = [[0, 0, 0], [255, 255, 255], [255, 0, 0], [0, 0, 255]]
    assert np.array_equal(im.rgb_to_grey(rgb), np.asarray(Image.fromarray(rgb).convert("L")))
    assert im.rgb_to_grey(rgb)[0, :4].tolist() == [0, 255, 76, 29]  # 0.299*255 = 76.2, 0.114*255 = 29.1


def test_pickle_folder_and_archive(tmp_path):
    data = make_cifar_pickle_dir(tmp_path)
    splits = im.read_image_source(data)
    assert len(splits["train"]) == 20 and len(splits["test"]) == 4
    batch = cifar_batch(4, 1)
    rgb = batch[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    assert np.array_equal(splits["train"].grey[:4], im.rgb_to_grey(rgb))  # planes R, G, B, row by row
    assert splits["train"].labels[:4].tolist() == batch[b"labels"]
    assert splits["train"].class_names == im.CIFAR10_CLASSES
    same = im.read_image_source(data / "cifar-10-batches-py")
    assert np.array_equal(same["test"].grey, splits["test"].grey)
    archived = im.read_image_source(write_tar(tmp_path / "cifar-10-python.tar.gz", cifar_pickle_files()))
    assert np.array_equal(archived["train"].grey, splits["train"].grey)


def test_image_folder_png_and_jpeg_archive_with_a_top_folder(tmp_path):
    files = image_folder_files(fmt="PNG")
    folder = im.read_image_source(write_files(tmp_path / "imgs", files))
    assert folder["train"].class_names == ("airplane", "cat", "dog")  # sorted folder names
    assert folder["train"].labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    from PIL import Image

    first = Image.open(io.BytesIO(files["train/airplane/0000.png"]))
    assert np.array_equal(folder["train"].grey[0], np.asarray(first.convert("L")))
    jpg = image_folder_files(fmt="JPEG", prefix="cifar10-jpeg/", test=False)
    jpg["cifar10-jpeg/README.md"] = b"readme"
    arch = im.read_image_source(write_tar(tmp_path / "jpeg.tar.gz", jpg))
    assert len(arch["train"]) == 9 and arch["test"] is None


def test_pixel_zero_is_a_real_pixel_never_padding(tmp_path):
    files = cifar_pickle_files(n=2)
    black = cifar_batch(2, 1)
    black[b"data"][:] = 0
    files["cifar-10-batches-py/data_batch_1"] = pickle.dumps(black, protocol=2)
    write_files(tmp_path / "c", files)
    splits, _ = im.load_images(tmp_path / "c")
    ds = splits["train"]
    assert ds.tokens.shape == (10, 1024) and ds.tokens.dtype == torch.uint8
    assert (ds.tokens[0] == 0).all() and ds.lengths.tolist() == [1024] * 10
    batch = LRAClassificationTask.batch(ds, torch.tensor([0, 1]), "cpu")
    assert batch["tokens"].shape == (2, 1024) and batch["tokens"].dtype == torch.int64
    assert not batch["padding_mask"].any()  # an all-black image is 1024 real pixels


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("payload, match", [
    (b"garbage bytes, not a pickle", "not a readable CIFAR python batch"),
    (pickle.dumps({b"data": _Evil(), b"labels": [0]}, protocol=2), "refusing to load posix.system|refusing to load"),
    (pickle.dumps({b"labels": [0]}, protocol=2), "no 'data'/'labels'"),
    (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, protocol=2), r"uint8 \(N, 3072\)"),
    (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, protocol=2), "1 labels for 2 images"),
    (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, protocol=2),
     "label 10 of image 1 is outside 0-9"),
    (pickle.dumps(cifar_batch(3, 0), protocol=2)[:200], "not a readable CIFAR python batch"),
])
def test_bad_batches_name_the_file(tmp_path, payload, match):
    files = cifar_pickle_files(n=2)
    files["cifar-10-batches-py/data_batch_3"] = payload
    write_files(tmp_path / "c", files)
    with pytest.raises(im.ImageFormatError, match=r"data_batch_3: .*(" + match + ")"):
        im.read_image_source(tmp_path / "c")


def test_missing_batch_and_unknown_layout(tmp_path):
    files = cifar_pickle_files(n=2)
    del files["cifar-10-batches-py/data_batch_4"]
    write_files(tmp_path / "c", files)
    with pytest.raises(im.ImageFormatError, match="missing CIFAR batch file.*data_batch_4"):
        im.read_image_source(tmp_path / "c")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither CIFAR python batches"):
        im.read_image_source(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not found"):
        im.read_image_source(tmp_path / "absent")
    with pytest.raises(im.ImageFormatError, match="no CIFAR batches"):
        im.read_image_source(write_tar(tmp_path / "other.tar.gz", {"x/readme.txt": b"hi"}))


def test_bad_images_name_the_file(tmp_path):
    files = image_folder_files(test=True)
    files["train/cat/0001.png"] = b"\x89PNG not really"
    write_files(tmp_path / "a", files)
    with pytest.raises(im.ImageFormatError, match=r"train/cat/0001.png: cannot decode image"):
        im.read_image_source(tmp_path / "a")
    files = image_folder_files(test=False)
    files["train/dog/0002.png"] = encode_image(np.zeros((16, 32), np.uint8), "PNG")
    write_files(tmp_path / "b", files)
    with pytest.raises(im.ImageFormatError, match=r"train/dog/0002.png: image is 32x16, expected 32x32"):
        im.read_image_source(tmp_path / "b")
    files = image_folder_files(test=True)
    files["test/zebra/0000.png"] = files["test/cat/0000.png"]
    with pytest.raises(im.ImageFormatError, match=r"test has class folder\(s\) \['zebra'\]"):
        im.read_image_source(write_tar(tmp_path / "c.tar.gz", files))
    (tmp_path / "d" / "train" / "cat").mkdir(parents=True)
    with pytest.raises(im.ImageFormatError, match=r"train/cat: no .png/.jpg images"):
        im.read_image_source(tmp_path / "d")


def test_truncated_archive_names_it(tmp_path):
    data = write_tar(tmp_path / "imgs.tar.gz", image_folder_files(n_per_class=20)).read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(im.ImageFormatError, match=r"cut.tar.gz: .*(truncated|corrupt)"):
        im.read_image_source(cut)


def test_cache_round_trip(tmp_path):
    data = make_cifar_pickle_dir(tmp_path, n=3)
    a, st = im.load_images(data, cache_dir=tmp_path / "cache")
    b, st2 = im.load_images(data, cache_dir=tmp_path / "cache")
    assert st.startswith("stored") and st2.startswith("hit")
    assert torch.equal(a["train"].tokens, b["train"].tokens) and b["test"].class_names == im.CIFAR10_CLASSES


@pytest.mark.skipif(not (SHARED / "cifar10" / "cifar10_jpeg_train.tar.gz").is_file(),
                    reason="shared CIFAR-10 JPEG copy ../shared/data/cifar10/cifar10_jpeg_train.tar.gz absent")
def test_shared_cifar_jpeg_archive_layout_and_first_images():
    path = SHARED / "cifar10" / "cifar10_jpeg_train.tar.gz"
    with tarfile.open(path, "r:gz") as tar:  # only the first members: the full read is `mgk data check`
        members = []
        for m in tar:
            if m.isfile() and m.name.endswith(".jpg"):
                members.append((m.name, tar.extractfile(m).read()))
            if len(members) == 5:
                break
    assert members[0][0] == "cifar10-jpeg/train/airplane/0000.jpg"
    for name, data in members:
        grey = im.decode_grey(data, name)
        assert grey.shape == (32, 32) and grey.dtype == np.uint8 and 0 < grey.mean() < 255
