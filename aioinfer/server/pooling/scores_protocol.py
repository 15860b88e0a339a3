"""vLLM's /score and the Jina / Cohere-style /rerank over an embedding model: a pair's score is
the cosine similarity of the two texts' embeddings. Request and response shapes, the pairing
and the ranking.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from aioinfer.core.pooling import score_pairs
from aioinfer.server.http.request_model import ModelRequest, RequestModel, RequestValidationError

_ALTERNATIVE = re.compile(r"\.(?:str|list\[str\]|DocumentObject)(?=[\[.:\s]|$)")


class _ScoringRequest(ModelRequest):
    @staticmethod
    def client_path(text: str) -> str:
        # pydantic also names the alternative a value was tried as (documents[0].str,
        # text_1.list[str][0]); the client wrote documents[0], text_1[0].
        return _ALTERNATIVE.sub("", text)

    model: str | None = Field(None, description="The served model name (default: the only one).")
    truncate_prompt_tokens: int | None = Field(
        None, description="Keep only each text's last k tokens (-1: what the context holds)."
    )
    priority: int = Field(
        0, description="With --scheduling-policy priority: lower runs first (vLLM's field)."
    )


class ScoreRequest(_ScoringRequest):
    """POST /score (and /v1/score): text_1 against each of text_2 (1:N), or pairwise (N:N)."""

    text_1: str | list[str] = Field(description="A text, or one per text of text_2.")
    text_2: str | list[str] = Field(description="The texts to score against text_1.")

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) of each score, in order: a single text_1 goes with every text_2."""
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        try:
            return score_pairs(firsts, seconds)
        except ValueError as exc:
            raise RequestValidationError(str(exc), str(exc).split(" ", 1)[0]) from None


class RerankDocument(TypedDict):
    text: str


class DocumentObject(RequestModel):
    text: str


class RerankRequest(_ScoringRequest):
    """POST /rerank (and /v1/rerank, /v2/rerank): the documents by relevance to the query."""

    query: str
    documents: list[str | DocumentObject] = Field(
        description='The texts to rank: strings, or objects {"text": ...}.'
    )
    top_n: int | None = Field(None, description="Return the best n (default, or 0: all).")
    return_documents: bool = Field(True, description="Include each document's text.")

    def check_supported(self) -> None:
        if not self.documents:
            raise RequestValidationError("documents must not be empty", "documents")
        if self.top_n is not None and self.top_n < 0:
            raise RequestValidationError(f"top_n must be >= 0, got {self.top_n}", "top_n")

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreData(TypedDict):
    index: int
    object: Literal["score"]
    score: float


class ScoreUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(TypedDict):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankResult(TypedDict):
    index: int
    relevance_score: float
    document: NotRequired[RerankDocument]


class RerankUsage(TypedDict):
    total_tokens: int


class RerankResponse(TypedDict):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def ranked(
    documents: list[str], scores: list[float], top_n: int | None, with_text: bool
) -> list[RerankResult]:
    """The documents best first (ties in input order), the best `top_n` (None or 0: all)."""
    # NaN (a broken embedding) last: it has no place in an order.
    order = sorted(range(len(documents)), key=lambda i: (math.isnan(scores[i]), -scores[i]))
    results: list[RerankResult] = []
    for index in order[: top_n or None]:
        result: RerankResult = {"index": index, "relevance_score": scores[index]}
        if with_text:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return results
