"""Training as library code: reading the data (`data`); the example script is a thin entry point over it."""

from .data import DATA_LAYOUTS, captions_of, load_coco2014, load_training_data, preprocess_image


__all__ = ["DATA_LAYOUTS", "captions_of", "load_coco2014", "load_training_data", "preprocess_image"]
