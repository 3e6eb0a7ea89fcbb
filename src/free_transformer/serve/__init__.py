"""An OpenAI-compatible HTTP server for a trained model (`free-transformer serve`, docs/serving.md):
config.py its settings (the command's options), protocol.py the request and response bodies, engine.py a request
checked into the rows it asks for,
batcher.py the one decoding loop that samples every request's rows together, app.py the FastAPI app.
Needs the `serve` extra (fastapi, uvicorn): only `free-transformer serve` imports this package, so the
rest of free_transformer works without it."""
