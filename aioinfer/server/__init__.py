"""The HTTP server, in layers that import only downwards: `http/` (infrastructure that knows no
API), `serving/` (what the APIs share), one package per API (`openai/`, `responses/`,
`anthropic/`, `pooling/`), and the composition root here (`app`, `routes`, `openapi`,
`launch`). tests/ship/test_server_layers.py holds the rule."""
