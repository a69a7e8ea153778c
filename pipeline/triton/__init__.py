"""Triton Inference Server deployment: model repositories generated from the config, and a server launcher.

- ``pbtxt``: typed builders for ``ModelConfig`` messages, printed with protobuf's text format.
- ``torch_repo``: the torch backend's repository (a Python-backend model that runs the executor).
- ``trtllm_repo``: the tensorrtllm_backend layout for TensorRT-LLM engines.
- ``repository``: ``deploy`` = write the right layout through a temp folder renamed on success.
- ``server``: start/stop a local ``tritonserver`` (the one shipped in the nvidia-pytriton wheel).
- ``request_inputs``: request validation shared by the Python model and its unit tests.
"""
