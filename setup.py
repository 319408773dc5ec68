from setuptools import find_packages, setup

setup(
    name="ttrace_megatron",
    version="0.1.0",
    description="Differential testing of Megatron-LM distributed training against a single-device reference (TTrace)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ttrace_megatron", "ttrace_megatron.*"]),
    install_requires=[
        # a floor, never a pin: a user's CUDA build of torch must not be replaced
        "torch>=2.3",
        # every release from 0.16 to 0.19 (adapter/recipe/compat.py); 0.17 on declare Python >= 3.12, so pip
        # picks 0.16.1 on Python 3.10 and 3.11 and the newest on 3.12
        "megatron-core>=0.16,<0.20",
        "numpy",
        "safetensors>=0.4",
        "rich>=13",
        "pyyaml>=6",
        # data files' checksums at memory speed (trace format 3)
        "xxhash>=3",
    ],
    extras_require={
        # the tests read back TensorBoard event files (scalars.py) with tensorboard's own reader
        "test": ["pytest>=7", "hypothesis>=6", "tensorboard>=2.10"],
        # `ttrace report DIR --tensorboard OUT` and online scalars outside Megatron-LM (which brings its own)
        "tensorboard": ["tensorboard>=2.10"],
        "te": ["transformer_engine[pytorch]"],
        # what Megatron-LM's training code (pretrain_gpt.py, megatron/training) imports beyond megatron-core's
        # own requirements, at core_v0.16.1 and core_v0.19.0 (checkout.TRAINING_IMPORTS says which module each is)
        "megatron-lm": ["six", "regex", "pydantic", "triton", "pybind11"],
    },
    entry_points={"console_scripts": ["ttrace=ttrace_megatron.cli:main"]},
)
