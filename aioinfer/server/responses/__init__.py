"""OpenAI's Responses API: requests as chats, outputs as items and named events, stored and
background responses."""
