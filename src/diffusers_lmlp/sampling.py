"""The sampler's defaults, which the pipeline, the trainer's validations and final scores, and the evaluation and
analysis commands share: both papers sample with 50 DPM-Solver++ steps at s = 1, diffusers' guidance g = s + 1."""

NUM_INFERENCE_STEPS = 50
GUIDANCE_SCALE = 2.0
