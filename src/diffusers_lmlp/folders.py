"""What the folders that diffusers and transformers save hold, for the checks that read a folder before loading it."""

# A CLIP tokenizer folder holds a fast tokenizer (`tokenizer.json`) or a slow one's vocabulary (`vocab.json`).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
# Weight files that load by unpickling (torch.save, PyTorch Lightning, pickle): the package never loads them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
