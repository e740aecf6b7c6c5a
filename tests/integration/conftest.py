"""Fixtures of the integration tests: one small checkpoint, local, on nginx and on SeaweedFS.

Servers come from ``tests/conftest.py``; data and helpers from ``integ_helpers``.
"""

from __future__ import annotations

import pytest
from integ_helpers import STATE, Checkpoint, s3_options, serve

from tensorstream import TensorSerializer


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, http_server, s3_server) -> Checkpoint:
    """STATE as ``.tensors`` and ``.safetensors``, locally, on nginx and on SeaweedFS."""
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("integ-ckpt")
    with TensorSerializer(tmp / "model.tensors") as ser:
        ser.write_state_dict(STATE)
    save_file(STATE, str(tmp / "model.safetensors"))
    bucket = s3_server.make_bucket("integ")
    return Checkpoint(
        serve(tmp / "model.tensors", "integ/model.tensors", http_server, s3_server, bucket),
        serve(tmp / "model.safetensors", "integ/model.safetensors", http_server, s3_server, bucket),
        bucket,
        s3_options(s3_server),
    )
