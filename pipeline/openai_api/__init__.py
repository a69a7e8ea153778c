"""An OpenAI-compatible HTTP endpoint in front of the Triton deployment (``serve CONFIG --openai``).

The proxy holds no model: every request becomes one request to Triton's decoupled ``speculative_stream`` model over
gRPC streaming, and a client that goes away (or a stop string that matches, the request's deadline, the server's
drain) cancels it, so the engine frees the batch slot within a step.

- ``errors``: the OpenAI error body and the one exception every layer raises for it.
- ``protocol``: OpenAI request bodies -> Triton inputs, checked field by field (one-line errors naming the field).
- ``stop``: stop strings matched on the generated text as it streams.
- ``triton_stream``: the async gRPC client of ``speculative_stream``; closing its iterator cancels the request.
- ``generation``: one request's run: Triton steps -> text pieces, stop strings applied, usage and statistics.
- ``responses``: OpenAI response bodies, stream chunks and server-sent events.
- ``app``: the Starlette ASGI app (routes, streaming, disconnects, deadlines) behind the front's guard.
- ``server``: the app on an HTTP front (pipeline/front/) beside tritonserver, on a socket bound before anything
  starts.
"""
