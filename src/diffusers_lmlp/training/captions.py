"""What a caption is, whatever the data source: one sample's non-empty string, or a non-empty list of them (COCO's five
per image)."""


def captions_of(value) -> list[str]:
    """The captions of one sample: a non-empty string, or a non-empty list of them.

    Args:
        value: The sample's caption column.

    Raises:
        `ValueError`: For anything else (None, a number, "", a list with a blank entry).
    """
    captions = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if not captions or not all(isinstance(c, str) and c.strip() for c in captions):
        raise ValueError(f"a caption must be a non-empty string or a non-empty list of them, got {value!r}")
    return captions
