"""The endpoints of pooling models: embeddings, classification, scores and reranking."""
