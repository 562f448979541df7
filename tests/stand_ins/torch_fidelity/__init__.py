"""A stand-in for torch-fidelity (which cannot be installed on the test machines: it pulls torchvision and a CUDA
torch), with its `FeatureExtractorInceptionV3` interface; only the README evaluation tests put it on `PYTHONPATH`."""
