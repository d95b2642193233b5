"""`stagewise serve`: the paged engine behind an OpenAI-compatible HTTP server.

A real engine is used over the network, not from one Python call: clients send
requests whenever they like, and continuous batching lets each one join the
running batch at the next step. The pieces, one file each:

- `protocol`     the OpenAI request fields -> a prompt and `SamplingParams`; the
                 response objects and OpenAI's error JSON
- `engine_loop`  ONE background thread that steps the engine; requests reach it
                 through a bounded queue, tokens go back to each request's asyncio queue
- `handle`       one request in flight: its engine `Request` and that asyncio queue
- `metrics`      the Prometheus counters, gauges and histograms of `GET /metrics`
- `app`          the Starlette application: its routes and how a response streams
- `guards`       what a request must be to be answered: its Host, a JSON body in time, the API key
- `server`       binding the socket, running uvicorn, draining on Ctrl-C / SIGTERM
- `limits`       what one request or client may cost the others (stop strings, view
                 streams, timeouts) and which Host names are answered
- `view`, `replay`  the live view of the scheduler and KV blocks (a browser page), and its replay
"""
