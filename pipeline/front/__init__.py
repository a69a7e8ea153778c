"""The fronts `serve` runs beside tritonserver, and what they share against hostile clients and pages.

- ``guard``: ASGI middleware that checks Host, Origin (CORS), the API key and the body's content type.
- ``http_server``: uvicorn on a thread on a pre-bound socket, with a read deadline, a connection limit and drain().
- ``triton_http``: Triton's HTTP/REST API forwarded to a tritonserver on loopback (the app behind the guard).
- ``grpc_proxy``: Triton's gRPC API forwarded after an API key check (when serve has a key).
"""
