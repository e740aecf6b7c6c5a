"""vLLM's tensorize example, run by tensorstream: serialize a model, or load it back.

Same arguments as ``tensorstream tensorize`` (and as vLLM's
``examples/others/tensorize_vllm_model.py``); see docs/tensorize.md. Examples::

    python examples/features/tensorize_vllm_model.py \\
        --model HuggingFaceTB/SmolLM2-135M-Instruct \\
        serialize --serialized-directory s3://my-bucket --suffix v1

    python examples/features/tensorize_vllm_model.py \\
        --model HuggingFaceTB/SmolLM2-135M-Instruct --dtype float16 \\
        deserialize --path-to-tensors \\
        s3://my-bucket/vllm/HuggingFaceTB/SmolLM2-135M-Instruct/v1/model.tensors
"""

import sys

from tensorstream.cli.tensorize import main

if __name__ == "__main__":
    sys.exit(main(prog="tensorize_vllm_model.py"))
