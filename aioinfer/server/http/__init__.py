"""HTTP infrastructure that knows no API: bodies, errors, auth, CORS, SSE, the request log,
metrics and the app's shared state. It imports nothing else of the server."""
