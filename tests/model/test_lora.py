"""LoRA adapters (PEFT's format) through the whole engine: greedy outputs equal transformers'
with the adapter merged into the weights (W + scale B A), in float32, for batches that mix
two adapters and the base model, and the prefix cache never shares K/V across adapters."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from aioinfer import LLM, LoRARequest
from aioinfer.model.cpu import kernels as cpu_native
from tests.offline.test_llm_vs_hf import GREEDY, hf_greedy, make_prompts
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import make_tokenizer

OPTIONS = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": 128, "enable_lora": True}
TARGETS = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


async def lora_engine(root: Path):
    """An engine over the base model with LoRA enabled, as `aioinfer serve` builds it."""
    from aioinfer.config import CacheConfig, ModelConfig, SchedulerConfig
    from aioinfer.engine.async_engine import AsyncEngine

    model_options = {k: v for k, v in OPTIONS.items() if k != "kv_cache_memory"}
    return await AsyncEngine.create(
        ModelConfig(model=str(root / "base"), **model_options),
        CacheConfig(kv_cache_memory=0.01),
        SchedulerConfig(),
    )


def write_adapter(
    hf: torch.nn.Module, path: Path, seed: int, rank: int = 4, alpha: float = 8.0, **config
) -> dict[str, torch.Tensor]:
    """A random PEFT adapter of `hf`'s projections; returns each adapted weight's delta."""
    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for layer in range(hf.config.num_hidden_layers):
        for name, block in TARGETS.items():
            module = f"model.layers.{layer}.{block}.{name}"
            linear = hf.get_submodule(module)
            a = torch.randn(rank, linear.in_features, generator=gen) * 0.1
            b = torch.randn(linear.out_features, rank, generator=gen) * 0.1
            tensors[f"base_model.model.{module}.lora_A.weight"] = a
            tensors[f"base_model.model.{module}.lora_B.weight"] = b
            deltas[f"{module}.weight"] = (alpha / rank) * b @ a
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                      "target_modules": list(TARGETS), **config}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return deltas


def merged(hf: torch.nn.Module, deltas: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, delta in deltas.items():
            model.get_parameter(name).add_(delta)
    return model


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    hf = make_variant("llama")
    hf.save_pretrained(root / "base")
    make_tokenizer().save_pretrained(root / "base")
    first = write_adapter(hf, root / "first", seed=1)
    second = write_adapter(hf, root / "second", seed=2, rank=2, use_rslora=True)
    # rsLoRA scales by alpha / sqrt(r): redo the second's deltas with that scale.
    second = {k: v * (2 / 2**0.5) for k, v in second.items()}
    references = {None: hf, "first": merged(hf, first), "second": merged(hf, second)}
    requests = {
        name: LoRARequest(name, index + 1, str(root / name))
        for index, name in enumerate(("first", "second"))
    }
    return root, references, requests


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_batch_mixing_adapters_equals_the_merged_models(lora_setup, backend):
    if backend == "native" and cpu_native.load() is None:
        pytest.skip(cpu_native.unavailable_reason())
    root, references, requests = lora_setup
    prompts = make_prompts(0, 512)
    names = ["first", None, "second", "first", None, "second", "second", "first"]
    options = {**OPTIONS, "attention_backend": backend, "cpu_kernels": backend}
    with LLM(str(root / "base"), **options) as llm:
        outputs = llm.generate(
            prompts, GREEDY, use_tqdm=False, lora_request=[requests.get(n) for n in names]
        )
    for prompt, name, output in zip(prompts, names, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(references[name], prompt), name
        assert output.lora_request is requests.get(name)  # as vLLM's RequestOutput


def test_the_prefix_cache_keeps_adapters_apart(lora_setup):
    root, references, requests = lora_setup
    prompt = make_prompts(1, 512, lengths=(40,))[0]
    order = ["first", None, "second", None, "first"]
    with LLM(str(root / "base"), max_num_seqs=1, **OPTIONS) as llm:
        got = [
            llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests.get(n))[0]
            for n in order
        ]
        assert llm.engine.scheduler.kv.stats.hits > 0  # the repeats did hit their own blocks
    for name, output in zip(order, got, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(references[name], prompt), name


def test_bad_adapters_are_refused_with_the_reason(lora_setup, tmp_path):
    root, references, requests = lora_setup
    hf = references[None]
    write_adapter(hf, tmp_path / "big", seed=3, rank=8)
    head = tmp_path / "head"
    write_adapter(hf, head, seed=4)
    extra = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
             "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 4)}  # fmt: skip
    save_file(extra, head / "adapter_model.safetensors")
    with LLM(str(root / "base"), max_lora_rank=4, max_loras=1, **OPTIONS) as llm:
        with pytest.raises(ValueError, match="rank 8, more than --max-lora-rank 4"):
            llm.generate(["hi"], GREEDY, lora_request=LoRARequest("big", 9, str(tmp_path / "big")))
        with pytest.raises(ValueError, match="'lm_head'"):
            llm.generate(["hi"], GREEDY, lora_request=LoRARequest("head", 8, str(head)))
        with pytest.raises(ValueError, match="not a LoRA adapter"):
            llm.generate(["hi"], GREEDY, lora_request=LoRARequest("x", 7, str(tmp_path)))
        both = [requests["first"], requests["second"]]
        with pytest.raises(ValueError, match="use 2 LoRA adapters; max_loras is 1"):
            llm.generate(["hi", "ho"], GREEDY, lora_request=both)
        assert (
            llm.engine.scheduler.kv.pool.num_free_blocks
            == llm.engine.scheduler.kv.pool.num_usable_blocks
        )
    with pytest.raises(ValueError, match="needs a generating model"):
        LLM(str(root / "base"), runner="pooling", **OPTIONS)
    without = {**OPTIONS, "enable_lora": False}
    with (
        LLM(str(root / "base"), **without) as llm,
        pytest.raises(ValueError, match="--enable-lora"),
    ):
        llm.generate(["hi"], GREEDY, lora_request=requests["first"])


async def test_the_server_routes_requests_by_adapter_name(lora_setup, aiohttp_client):
    """`model` picks the adapter (as vLLM's --lora-modules names it); /v1/models lists the
    adapters with the served model as their parent; responses name the adapter."""
    from aioinfer.config import ServerConfig
    from aioinfer.server.app import create_app

    root, references, requests = lora_setup
    engine = await lora_engine(root)
    try:
        for request in requests.values():
            await engine.add_lora(request)
        modules = tuple(f"{r.lora_name}={r.lora_path}" for r in requests.values())
        client = await aiohttp_client(create_app(engine, ServerConfig(lora_modules=modules)))
        models = (await (await client.get("/v1/models")).json())["data"]
        assert [m["id"] for m in models] == [engine.model_name, "first", "second"]
        assert models[1]["parent"] == engine.model_name
        assert models[1]["root"] == "first"  # its name: never its folder on the server
        prompt = make_prompts(2, 512, lengths=(12,))[0]
        for name in ("second", engine.model_name, "first"):
            body = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            data = await response.json()
            assert response.status == 200, data
            assert data["model"] == name
            reference = references.get(name)  # the served model's name maps to None
            expected = hf_greedy(reference if reference is not None else references[None], prompt)
            assert data["choices"][0]["token_ids"] == expected, name
        metrics = await (await client.get("/metrics")).text()
        assert 'aioinfer:lora_requests_info{max_lora="4",running_lora_adapters="",' in metrics
        response = await client.post("/v1/completions", json={"model": "third", "prompt": "hi"})
        error = (await response.json())["error"]
        assert response.status == 404 and "first, second" in error["message"]
        # Chat, the Responses API and the Messages API pick the adapter the same way.
        texts = {}
        for name in ("first", engine.model_name):
            chat = {"model": name, "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 6, "temperature": 0}  # fmt: skip
            data = await (await client.post("/v1/chat/completions", json=chat)).json()
            assert data["model"] == name
            texts[name] = data["choices"][0]["message"]["content"]
        assert texts["first"] != texts[engine.model_name]
        body = {"model": "first", "input": "hello there", "max_output_tokens": 6,
                "temperature": 0}  # fmt: skip
        data = await (await client.post("/v1/responses", json=body)).json()
        assert data["model"] == "first"
        assert data["output"][-1]["content"][0]["text"] == texts["first"]
        body = {"model": "first", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 6, "temperature": 0}  # fmt: skip
        data = await (await client.post("/v1/messages", json=body)).json()
        assert data["model"] == "first" and data["content"][0]["text"] == texts["first"]
    finally:
        await engine.shutdown()


def test_serve_loads_the_lora_modules_it_is_given(lora_setup):
    """`aioinfer serve --enable-lora --lora-modules NAME=PATH` (twice): both adapters listed."""
    import urllib.request

    from tests.support.serve_process import ServeProcess, free_port

    root, _, requests = lora_setup
    port = free_port()
    args = [str(root / "base"), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--kv-cache-memory", "0.01", "--max-model-len", "128", "--enable-lora"]  # fmt: skip
    for request in requests.values():
        args += ["--lora-modules", f"{request.lora_name}={request.lora_path}"]
    proc = ServeProcess(args)
    try:
        proc.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as response:
            models = json.loads(response.read())["data"]
        assert [m["id"] for m in models][1:] == ["first", "second"]
        assert any("Loaded LoRA adapter 'second'" in line for line in proc.lines)
    finally:
        assert proc.stop() == 0


async def test_adapters_load_and_unload_at_runtime(lora_setup, aiohttp_client, monkeypatch):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, behind their environment
    switch; an adapter in use is not unloaded, and one loaded again gets a fresh slot (its
    old cached prefix blocks are never served to it)."""
    from aioinfer.config import ServerConfig
    from aioinfer.core.sampling_params import SamplingParams
    from aioinfer.server.app import create_app
    from aioinfer.server.openai.lora import RUNTIME_LORA_ENV

    root, references, requests = lora_setup
    engine = await lora_engine(root)
    try:
        closed = await aiohttp_client(create_app(engine, ServerConfig()))
        response = await closed.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert response.status == 404  # not served without the switch
        monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
        client = await aiohttp_client(create_app(engine, ServerConfig(lora_root=str(root))))
        first = {"lora_name": "first", "lora_path": requests["first"].lora_path}
        prompt = make_prompts(4, 512, lengths=(33,))[0]

        async def complete() -> tuple[int, dict]:
            body = {"model": "first", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            return response.status, await response.json()

        response = await client.post("/v1/load_lora_adapter", json=first)
        assert response.status == 200
        assert await response.text() == "Success: LoRA adapter 'first' added successfully."
        expected = hf_greedy(references["first"], prompt, max_new=8)
        status, data = await complete()
        assert status == 200 and data["choices"][0]["token_ids"] == expected
        response = await client.post("/v1/load_lora_adapter", json=first)
        assert response.status == 400 and "already been loaded" in await response.text()
        bad = {"lora_name": "bad", "lora_path": str(root)}
        response = await client.post("/v1/load_lora_adapter", json=bad)
        assert response.status == 400 and (await response.json())["error"]["param"] == "lora_path"

        stream = engine.add_request(prompt, SamplingParams(max_tokens=4), lora="first")
        with pytest.raises(ValueError, match="in use by 1 unfinished"):
            await engine.remove_lora("first")
        while not (await stream.get()).finished:
            pass
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "first"})
        assert response.status == 200
        assert (await complete())[0] == 404
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "first"})
        assert response.status == 404
        # The name again, now for other weights: a fresh slot, so the prompt's blocks cached
        # under the old adapter are not served to the new one.
        renamed = {"lora_name": "first", "lora_path": requests["second"].lora_path}
        assert (await client.post("/v1/load_lora_adapter", json=renamed)).status == 200
        status, data = await complete()
        assert status == 200
        assert data["choices"][0]["token_ids"] == hf_greedy(references["second"], prompt, 8)
    finally:
        await engine.shutdown()


def test_the_offline_api_swaps_adapters_through_its_slots(lora_setup, tmp_path):
    """With one slot, each call's adapter replaces the last one; a name given with another
    path runs the new weights; an adapter_config.json without r and lora_alpha takes PEFT's
    defaults (8 and 8: scale 1)."""
    root, references, requests = lora_setup
    prompt = make_prompts(5, 512, lengths=(21,))[0]
    deltas = write_adapter(references[None], tmp_path / "plain", seed=6, rank=8, alpha=8.0)
    config = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    del config["r"], config["lora_alpha"]
    (tmp_path / "plain" / "adapter_config.json").write_text(json.dumps(config))
    plain = merged(references[None], deltas)
    calls = [
        (requests["first"], references["first"]),
        (requests["second"], references["second"]),
        (LoRARequest("first", 3, requests["second"].lora_path), references["second"]),
        (LoRARequest("plain", 4, str(tmp_path / "plain")), plain),
        (requests["first"], references["first"]),
    ]
    with LLM(str(root / "base"), max_loras=1, **OPTIONS) as llm:
        messages = [{"role": "user", "content": "hello there"}]
        plain_chat = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        first_chat = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=requests["first"])
        assert first_chat[0].outputs[0].token_ids != plain_chat
        for lora, reference in calls:
            (output,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
            assert output.outputs[0].token_ids == hf_greedy(reference, prompt), lora
            assert list(llm.engine.loras.slots) == [lora.lora_name]
