"""A request's own chat template renders in a child process under a budget: as transformers
renders it, but never past its CPU time, its memory or its output size, stopped as soon as its
client leaves, and never kept compiled."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest

from aioinfer.engine.template_budget import TemplateBudgetError, TemplateRenderer
from tests.support.tokenizers import make_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
OPTIONS = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "tools": None,
    "documents": None,
}
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
MiB = 1 << 20


@pytest.fixture(scope="module")
def renderer() -> Iterator[TemplateRenderer]:
    renderer = TemplateRenderer()
    yield renderer
    renderer.close()


def render(
    renderer: TemplateRenderer,
    template: str,
    max_chars: int = MiB,
    cpu_seconds: float = 1.0,
    cancelled: threading.Event | None = None,
    **options: Any,
) -> str:
    return renderer.render(
        template, MESSAGES, {**OPTIONS, **options}, {}, max_chars, cpu_seconds, cancelled
    )


def rss(pid: int | str = "self") -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_it_renders_what_apply_chat_template_renders(renderer):
    tok = make_tokenizer()
    template = (
        "{% for m in messages %}<{{ m.role }}:{{ m.content }}>{% endfor %}"
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for d in documents %}({{ d.title }}){% endfor %}"
        "{{ eos_token }}{{ mood }}{% if add_generation_prompt %}<assistant:{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    documents = [{"title": "A", "text": "alpha"}]
    continued = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    for messages, generation, continue_final in ((MESSAGES, True, False), (continued, False, True)):
        expected = tok.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=generation,
            continue_final_message=continue_final,
            mood="calm",
        )
        options = {
            "add_generation_prompt": generation,
            "continue_final_message": continue_final,
            "tools": tools,
            "documents": documents,
        }
        variables = {**tok.special_tokens_map, "mood": "calm"}
        assert renderer.render(template, messages, options, variables, MiB, 1.0) == expected


def test_loops_stop_at_the_cpu_budget(renderer):
    render(renderer, "{{ 1 }}")  # started
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError, match=r"budget of 0\.3 s of CPU time"):
        render(renderer, NESTED_LOOPS, cpu_seconds=0.3)
    assert time.monotonic() - start < 5  # a busy machine's wall time, for 0.3 s of CPU
    assert render(renderer, "{{ messages[0].content }}") == "hi"  # the same child goes on


def test_memory_past_the_budget_is_refused_and_the_server_keeps_none(renderer):
    before = rss()
    for template in (
        "{% set s = 'x' * 10**9 %}{{ s|length }}",  # folded into the compiled code
        "{{ range(100000)|join('y' * 100000) }}",  # one C call: 10 GB
        "{{ ('{0:{1}}' * 8000).format('x', 1000000)|length }}",  # 8 GB of padding
    ):
        with pytest.raises(TemplateBudgetError, match="MiB of memory"):
            render(renderer, template)
    assert rss() - before < 50 * MiB
    assert render(renderer, "{{ messages[0].content }}") == "hi"  # a fresh child


def test_an_output_past_max_chars_is_refused(renderer):
    assert render(renderer, "{{ 'y' * 100 }}", max_chars=100) == "y" * 100
    with pytest.raises(TemplateBudgetError, match="wrote 101 characters, past its budget of 100"):
        render(renderer, "{{ 'y' * 101 }}", max_chars=100)


def test_a_template_s_own_errors_are_template_errors(renderer):
    for template, fragment in (
        ("{{ raise_exception('boom') }}", "boom"),
        ("{{ 1 / 0 }}", "division by zero"),
        ("{{ [].append(1) }}", "unsafe"),
        ("{% include '/etc/passwd' %}", "no loader"),
        ("{{ '\\ud800' }}", "not Unicode"),
    ):
        with pytest.raises(jinja2.TemplateError, match=fragment) as info:
            render(renderer, template)
        assert not isinstance(info.value, TemplateBudgetError)


def test_a_rendering_whose_client_left_is_stopped_at_once(renderer):
    render(renderer, "{{ 1 }}")  # started
    pid = renderer.pid
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError, match="its client left"):
        render(renderer, NESTED_LOOPS, cpu_seconds=60, cancelled=cancelled)
    assert time.monotonic() - start < 2
    assert renderer.pid is None and not Path(f"/proc/{pid}").exists()  # killed, and reaped


def test_templates_are_not_kept_compiled(renderer):
    """transformers caches compiled templates, and Jinja folds `'x' * N` into the compiled
    code: 8 MB a template, kept for the process's life, until the budget ran out."""
    render(renderer, "{{ 1 }}")  # started
    pid = renderer.pid
    assert pid is not None
    at_rest = rss(pid)
    for n in range(10):
        template = "{% set s = 'x' * " + str(8 * MiB + n) + " %}{{ s|length }}"
        assert render(renderer, template) == str(8 * MiB + n)
    assert renderer.pid == pid and rss(pid) - at_rest < 40 * MiB
