"""The CPU engine's KV page prefaulter (model/cpu/kv_prefault.py) in place: it follows the highest
block the steps use, and the engine's shutdown stops it."""

from __future__ import annotations

import gc
import threading
import time

from aioinfer import LLM, SamplingParams
from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
from aioinfer.gpu import runner as runner_module
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer


def prefault_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aioinfer-kv-prefault"]


def test_the_prefaulter_keeps_a_lookahead_past_the_blocks_used_until_shutdown(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(runner_module, "PREFAULT_MAX_BYTES", 1 << 20)  # 1 MiB at most here
    make_variant("llama").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    before = len(prefault_threads())
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=0.05, max_model_len=128)
    try:
        runner = llm.engine.gpu.runner
        prefaulter = runner.kv_prefaulter
        bytes_per_block = runner.kv_caches[0][0].nbytes * len(runner.kv_caches)
        four_steps = 4 * (
            runner.info.max_num_batched_tokens // runner.block_size + runner.max_num_seqs
        )
        lookahead = min(four_steps, (1 << 20) // bytes_per_block)
        assert prefaulter.lookahead_blocks == lookahead < prefaulter.num_blocks
        prompts = [[5 + i, 17, 300 + i] * 30 for i in range(8)]  # 90 tokens: 6 blocks each
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        # The blocks the requests took (from block 1 up) moved the target past the start's.
        assert prefaulter._target > 1 + lookahead
        deadline = time.monotonic() + 10
        while prefaulter.faulted_blocks < prefaulter._target:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(prefault_threads()) == before + 1
    finally:
        llm.shutdown()
    assert not prefaulter.running
    assert len(prefault_threads()) == before


def test_a_runner_dropped_without_close_ends_its_prefaulter(tmp_path):
    """The thread holds the KV cache: it must not outlive its runner and keep the cache."""
    make_variant("llama").save_pretrained(tmp_path)
    config = ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=128)
    runner = runner_module.ModelRunner(
        runner_module.ModelRunner.resolve(config), config, CacheConfig(kv_cache_memory=0.01),
        SchedulerConfig(),
    )  # fmt: skip
    prefaulter = runner.kv_prefaulter
    assert prefaulter is not None and prefaulter.running
    del runner
    gc.collect()
    deadline = time.monotonic() + 10
    while prefaulter.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
