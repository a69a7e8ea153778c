"""Triton Inference Server deployment: model repositories generated from the config, and a server launcher.

- ``pbtxt``: typed builders for ``ModelConfig`` messages, printed with protobuf's text format.
- ``torch_repo``: the torch backend's repository (Python-backend models around the batched engine).
- ``trtllm_repo``: the tensorrtllm_backend layout for TensorRT-LLM engines; ``trtllm_tensors``: its tensor tables.
- ``repository``: ``deploy`` = write the right layout through a temp folder renamed on success.
- ``server``: start/stop a local ``tritonserver`` (the one shipped in the nvidia-pytriton wheel).
- ``procfs``: what /proc says about a running server (its model processes, its listening ports).
- ``request_inputs``: one request's input tensors -> executor arguments, importable without Triton.
- ``cli``: the ``deploy`` and ``serve`` subcommands.
"""
