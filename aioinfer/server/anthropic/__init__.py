"""Anthropic's Messages API: requests as chats, outputs as content blocks and named events."""
