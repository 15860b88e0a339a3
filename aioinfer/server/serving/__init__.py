"""What more than one API serves through: admission and generation, chat rendering, the chat
request they all become, answers as JSON or SSE, and the renderers of reasoning, tool calls
and logprobs. It imports http/ only, never an API package."""
