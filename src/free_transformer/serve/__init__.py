"""An OpenAI-compatible HTTP server for a trained model (`free-transformer serve`, docs/serving.md):
protocol.py the request and response bodies, engine.py the model behind them (one request at a time),
app.py the FastAPI app. Needs the `serve` extra (fastapi, uvicorn): only `free-transformer serve`
imports this package, so the rest of free_transformer works without it."""
