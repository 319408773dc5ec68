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
        "megatron-core>=0.16,<0.17",
        "numpy",
        "safetensors>=0.4",
        "rich>=13",
        "pyyaml>=6",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6"],
        "te": ["transformer_engine[pytorch]"],
    },
    entry_points={"console_scripts": ["ttrace=ttrace_megatron.cli:main"]},
)
