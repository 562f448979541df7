from setuptools import find_packages, setup


# torch is not pinned here: install the build that fits your machine first (the README pins torch==2.13.0, the
# CPU build; on a GPU machine install your CUDA build of torch instead).
# The floors are the lowest versions that resolve together (transformers 5 and diffusers 0.40 both need
# huggingface_hub 1.x) and pass the model, pipeline and LoRA tests: CI installs exactly these floors and runs them
# (scripts/test_lowest_versions.sh). torch's floor is the one exception: only the 2.13.0 CPU build is tested.
install_requires = [
    "torch>=2.5",
    "diffusers>=0.40",
    "transformers>=5.0",
    "accelerate>=1.0",
    "safetensors>=0.8",
    "huggingface_hub>=1.23",
    "datasets>=3.0",
]

extras = {
    # peft: LoRA adapters on the backbones (`model.add_adapter`, `--lora_rank`); 0.17 still imports what transformers
    # 5 removed, and 0.18/0.19 allow one adapter with `target_parameters` per model (SymMixer's tied weights).
    "train": ["tensorboard", "tqdm", "peft>=0.20"],
    "space": ["gradio>=6"],
    # matplotlib: the analysis figures and the benchmarks' charts (docs/*.png); 3.6 has the constrained layout they use.
    "plots": ["matplotlib>=3.6"],
    # The Space tests serve the app and drive it with gradio_client and a headless chromium through playwright (the
    # browser itself comes from the system: `apt-get install chromium`).
    # wandb: the test that validation images reach wandb runs it offline (no account, nothing sent).
    # torchmetrics: the independent reference the FID and CLIP score tests compare with.
    "test": [
        "pytest>=8",
        "pytest-xdist>=3.6",
        "ruff",
        "peft>=0.20",
        "tensorboard",
        "wandb",
        "gradio>=6",
        "gradio_client",
        "playwright",
        "torchmetrics",
        "matplotlib>=3.6",
    ],
}
extras["all"] = sorted({req for reqs in extras.values() for req in reqs})

setup(
    name="diffusers-lmlp",
    version="0.1.0.dev0",
    description="Attention-free MLP diffusion backbones (L-MLP, MoE-MLP) for Hugging Face diffusers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # The Gradio demo Space lives in spaces/lmlp-demo/, a folder that is uploaded to a Space as it is. The wheel ships
    # that one folder as diffusers_lmlp/space/lmlp_demo/, so that `python -m diffusers_lmlp.hub push-space` works
    # from a pip install too (hub/space.py finds either place).
    package_dir={"": "src", "diffusers_lmlp.space.lmlp_demo": "spaces/lmlp-demo"},
    packages=[*find_packages("src"), "diffusers_lmlp.space.lmlp_demo"],
    # The shapes and emoji worlds' data, trained components and pipelines ship inside the package, so pip users get
    # them offline.
    package_data={
        "diffusers_lmlp": [
            "emoji/assets/world/*",
            "emoji/assets/clip/*",
            "emoji/assets/pipeline/*.json",
            "emoji/assets/pipeline/*.md",
            "emoji/assets/pipeline/*.png",
            "emoji/assets/pipeline/*/*.json",
            "emoji/assets/pipeline/*/*.safetensors",
            "emoji/assets/pipeline/*/*.txt",
            "shapes/assets/*/*.json",
            "shapes/assets/*/*.safetensors",
            "shapes/assets/*/*/*.json",
            "shapes/assets/*/*/*.safetensors",
            "shapes/assets/*/*/*.txt",
            "shapes/assets/*/*.md",
            "shapes/assets/*/*.png",
        ],
        # Every file of the demo (app.py comes as the mapped package's module).
        "diffusers_lmlp.space.lmlp_demo": ["*"],
    },
    # The package's commands, also runnable as `python -m diffusers_lmlp.<train|evaluation|hub|analysis>`.
    entry_points={
        "console_scripts": [
            "diffusers-lmlp-train = diffusers_lmlp.train:cli",
            "diffusers-lmlp-evaluate = diffusers_lmlp.evaluation.__main__:main",
            "diffusers-lmlp-hub = diffusers_lmlp.hub.__main__:main",
            "diffusers-lmlp-analysis = diffusers_lmlp.analysis.__main__:main",
        ]
    },
    python_requires=">=3.11",
    install_requires=install_requires,
    extras_require=extras,
)
