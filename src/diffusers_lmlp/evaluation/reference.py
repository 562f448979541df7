"""FID reference statistics: a published `.npz`, or computed once from a folder of real images and cached."""

import hashlib
import json
from pathlib import Path

from huggingface_hub import constants
from PIL import Image, UnidentifiedImageError

from ..image_tensors import center_crop_resize, images_to_tensor
from ..progress import progress_bar
from .extractors import extractor_name, feature_size, image_features
from .fid import FeatureMoments, FIDStatistics


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def reference_statistics(
    reference, extractor, resolution: int, *, processes, cache_dir=None, batch_size: int = 50, progress: bool = True
) -> FIDStatistics:
    """The statistics FID compares with (`FIDStatistics`, an `.npz` of `mu` and `sigma`, or a folder of real images,
    centre-cropped and resized to `resolution`, its statistics cached under `cache_dir`), checked against the
    feature network `extractor` (`ValueError` on a mismatch); `processes`: this process's share of the work."""
    name = extractor_name(extractor)
    if isinstance(reference, FIDStatistics):
        statistics, source = reference, "the given statistics"
    else:
        source = Path(reference)
        if source.is_dir():
            statistics = folder_statistics(source, extractor, resolution, processes, cache_dir, batch_size, progress)
        else:
            check_exists(source)
            statistics = FIDStatistics.load(source)
    if statistics.extractor is not None and statistics.extractor != name:
        raise ValueError(f"FID reference {source} was computed with {statistics.extractor}, not {name}: recompute it "
                         "with this network or pass the matching one")  # fmt: skip
    num_features = feature_size(extractor, resolution)
    if statistics.mu.size != num_features:
        raise ValueError(f"FID reference {source} holds {statistics.mu.size}-d statistics, but {name} gives "
                         f"{num_features}-d features: the reference must come from the same network")  # fmt: skip
    return statistics


def check_exists(reference) -> None:
    """Fail before any model loads for a reference path that does not exist."""
    if not isinstance(reference, FIDStatistics) and not Path(reference).exists():
        raise ValueError(f"FID reference {reference}: no such file or folder; pass an .npz of mu/sigma, a folder of "
                         "real images, or a world's name (shapes, emoji) on its captions")  # fmt: skip


def folder_statistics(
    folder: Path, extractor, resolution, processes, cache_dir, batch_size, progress
) -> FIDStatistics:
    """The statistics of every image under `folder`, cached under a key of the network, the resolution and every
    file's path, size and mtime."""
    files = sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())
    if len(files) < 2:
        raise ValueError(f"FID reference folder {folder} holds {len(files)} image(s) "
                         f"({', '.join(sorted(IMAGE_SUFFIXES))}); FID needs many real images")  # fmt: skip
    name = extractor_name(extractor)
    listing = [(str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    key = hashlib.sha256(json.dumps([name, resolution, listing]).encode()).hexdigest()[:16]
    cache_dir = cache_dir or Path(constants.HF_HOME) / "diffusers_lmlp" / "fid_stats"
    cache = Path(cache_dir) / f"{folder.resolve().name}-{resolution}px-{key}.npz"
    if cache.is_file():
        return FIDStatistics.load(cache)
    moments = FeatureMoments(feature_size(extractor, resolution))
    batches = processes.batches(len(files), batch_size)
    bar = progress_bar(len(files), "reference", unit="img", disable=not progress or processes.index != 0)
    for batch in batches:
        images = []
        for i in batch:
            try:
                with Image.open(files[i]) as image:
                    images.append(center_crop_resize(image, resolution))
            except (UnidentifiedImageError, OSError) as error:
                raise ValueError(f"FID reference folder: cannot read {files[i]} as an image ({error})") from None
        moments.update(image_features(extractor, images_to_tensor(images)))
        bar.update(min(len(batch) * processes.count, bar.total - bar.n))
    bar.close()
    moments.reduce(processes.device)
    statistics = moments.statistics(name)
    if processes.index == 0:
        statistics.save(cache)
    processes.wait()
    return statistics
