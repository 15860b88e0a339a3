"""The request log's text line under --log-prompts: each prompt and output clipped to
--max-log-len characters."""

from __future__ import annotations

import logging

from aioinfer.core.outputs import CompletionOutput
from aioinfer.server.http.request_log import RequestRecord


def test_texts_are_clipped_to_max_log_len(caplog):
    caplog.set_level(logging.INFO, logger="aioinfer.server.http.request_log")
    record = RequestRecord("/v1/completions", keep_text=True, max_text=5)
    record.prompt_texts = ["abcdefgh", "xyz", None]
    record.add(0, CompletionOutput(index=0, text="0123456789", token_ids=[1, 2]))
    record.log()
    [text_line] = [r.getMessage() for r in caplog.records if " text: " in r.getMessage()]
    assert text_line.endswith("prompts=['abcde...', 'xyz', None] outputs=['01234...']")
