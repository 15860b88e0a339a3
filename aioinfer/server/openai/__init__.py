"""OpenAI's and vLLM's endpoints: completions, chat completions, models, tokenize and
detokenize, runtime LoRA adapters."""
