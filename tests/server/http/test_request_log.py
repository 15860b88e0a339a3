"""The request log's text line under --log-prompts: each prompt and output clipped to
--max-log-len characters, and kept only that far."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from aioinfer.core.outputs import CompletionOutput
from aioinfer.server.http.request_log import MAX_TEXTS_LOGGED, RequestRecord


def test_texts_are_clipped_to_max_log_len(caplog):
    caplog.set_level(logging.INFO, logger="aioinfer.server.http.request_log")
    record = RequestRecord("/v1/completions", keep_text=True, max_text=5)
    record.prompt_texts = ["abcdefgh", "xyz", None]
    record.add(0, CompletionOutput(index=0, text="0123456789", token_ids=[1, 2]))
    record.log()
    [text_line] = [r.getMessage() for r in caplog.records if " text: " in r.getMessage()]
    assert text_line.endswith("prompts=['abcde...', 'xyz', None] outputs=['01234...']")


def test_a_long_output_is_kept_only_as_far_as_it_is_logged(caplog):
    """Each delta was appended to the whole text so far (quadratic in the output), and the
    whole output was kept until the request ended, though --max-log-len clips what is logged.
    Now only max_log_len + 1 characters of each text are kept, and one line logs at most
    MAX_TEXTS_LOGGED prompts and outputs."""
    caplog.set_level(logging.INFO, logger="aioinfer.server.http.request_log")
    record = RequestRecord("/v1/completions", keep_text=True, max_text=100)
    started = SimpleNamespace(response_id="cmpl-1", prompt_tokens=3)
    record.start(started, ["p" * 10_000] + [f"prompt {i}" for i in range(99)])
    for _ in range(30_000):
        record.add(0, CompletionOutput(index=0, text="ab", token_ids=[1]))
    for i in range(1, 40):
        record.add(0, CompletionOutput(index=i, text="\n", token_ids=[1]))
    kept = sum(len(piece) for pieces in record.outputs.values() for piece in pieces)
    assert kept <= 101 + 39 and len(record.prompt_texts[0] or "") <= 103
    assert record.completion_tokens == 30_039
    record.log()
    [line] = [r.getMessage() for r in caplog.records if " text: " in r.getMessage()]
    assert len(line) < MAX_TEXTS_LOGGED * 2 * 120 and "\n" not in line
    assert "'" + "ab" * 50 + "...'" in line
    assert "(and 84 more)" in line and "(and 24 more)" in line
